"""What the weights occupy and in which form, printed at start-up and on /server_info.

Per tensor class (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head; an MoE's
experts.gate_up and experts.down, counted per expert): how many linears
run which GGUF types in which record form (gguf_records.FORMS), the records' bytes; the
float copies kept for large batches and why; the linears left float and why (a GGUF
type with no native kernel is named with its tensors); the other float parameters
(embedding, norms)."""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from typing import Any

import torch
from torch import nn

from tokenmill.quant import huge_pages
from tokenmill.quant.embedding import LookupEmbedding
from tokenmill.quant.gguf_triton import GgufTritonLinear
from tokenmill.quant.linear import QuantizedLinear
from tokenmill.quant.moe_experts import RecordExperts

logger = logging.getLogger(__name__)
_MIB = 2**20


def weight_report(model: nn.Module, summary: Any, batched_linears: str,
                  float_copy: int) -> dict[str, Any]:
    """summary: quantize_model's QuantizationSummary; float_copy: bytes a bf16 copy of
    the quantized linears would take (what --batched-linears bf16 keeps)."""
    classes: dict[str, Counter[str]] = defaultdict(Counter)
    lowbit_ptrs: set[int] = set()
    embedding_bytes = 0
    records = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, "vnni_packed", None), torch.Tensor):
            records.append(module.vnni_packed)
        if isinstance(module, QuantizedLinear):
            form = getattr(module, "weight_form", None) or type(module).__name__
            types = getattr(module, "gguf_types", None)
            classes[name.rpartition(".")[2]][f"{types} as {form}" if types else form] += 1
            lowbit_ptrs.update(b.data_ptr() for b in module.buffers())
        elif isinstance(module, GgufTritonLinear):  # the GPU's GGUF blocks
            classes[name.rpartition(".")[2]][f"{module.gguf_types} as triton blocks"] += 1
        elif isinstance(module, RecordExperts):  # MoE experts: counted per expert
            for cls, forms in module.forms.items():
                classes[cls].update(forms)
        elif isinstance(module, LookupEmbedding):
            embedding_bytes = module.resident_bytes()
    seen: set[int] = set()
    other = 0
    for p in model.parameters():  # embedding, norms, float linears (a tied head once)
        if p.data_ptr() not in seen and p.data_ptr() not in lowbit_ptrs:
            seen.add(p.data_ptr())
            other += p.numel() * p.element_size()
    if summary.dense_bytes:
        why = (f"--batched-linears {batched_linears}: a matmul on it is faster for large "
               "batches")
    elif batched_linears == "none":
        why = (f"none kept: a bf16 copy would take {float_copy / _MIB:.0f} MiB "
               "(--batched-linears bf16 keeps one)")
    else:
        why = "none kept"
    return {
        "method": summary.method,
        "method_reason": getattr(summary, "reason", "") or summary.method,
        "linears": {k: dict(v) for k, v in classes.items()},
        "lowbit_bytes": summary.lowbit_bytes,
        # of the kernel records, how many bytes the OS gave transparent huge pages (a
        # decode step streams them all: 4 KiB pages cost TLB misses and stop the
        # prefetchers at every page); None where not read (smaller records) or unreadable
        "records_huge_page_bytes": huge_pages.huge_page_bytes(records)
        if records and summary.lowbit_bytes >= huge_pages.REPORT_MIN_BYTES else None,
        "float_copy_bytes": summary.dense_bytes,
        "float_copy": why,
        "kept_float": dict(summary.kept_float),
        "embedding": getattr(summary, "embedding", "float"),
        "embedding_bytes": embedding_bytes,
        "other_float_bytes": other,
        # what the weights occupy in all (a tied embedding's rows in the head's records)
        "resident_bytes": summary.lowbit_bytes + summary.dense_bytes + embedding_bytes + other,
    }


def log_report(report: dict[str, Any]) -> None:
    """The start-up lines: one for the forms, a warning per GGUF type left float."""
    forms = "; ".join(f"{cls}: " + ", ".join(f"{form} x{n}" for form, n in sorted(v.items()))
                      for cls, v in report["linears"].items())
    huge = report.get("records_huge_page_bytes")
    logger.info("weights (%s): %s; %.1f MiB in all: records %.1f MiB%s, float copies %.1f MiB (%s), other "
                "float parameters %.1f MiB; embedding %s",
                report.get("method_reason") or report["method"],
                forms or "no low-bit linears", report["resident_bytes"] / _MIB,
                report["lowbit_bytes"] / _MIB,
                "" if huge is None else f" ({huge / _MIB:.1f} MiB on huge pages)",
                report["float_copy_bytes"] / _MIB, report["float_copy"],
                report["other_float_bytes"] / _MIB, report["embedding"]
                + (f" ({report['embedding_bytes'] / _MIB:.1f} MiB)" if report["embedding_bytes"]
                   else ""))
    by_reason: dict[str, list[str]] = defaultdict(list)
    for name, why in report["kept_float"].items():
        by_reason[why].append(name)
    for why, names in by_reason.items():
        logger.warning("weights: %d linears float (%s): %s%s", len(names), why,
                       ", ".join(names[:4]), ", ..." if len(names) > 4 else "")
