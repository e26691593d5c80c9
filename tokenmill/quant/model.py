"""Swap a loaded model's linears for quantized ones, by name, from outside the model.

Targets are the submodules named qkv_proj, o_proj, gate_up_proj, down_proj and
lm_head. Methods:
  none  keep float weights (and drop the GGUF blocks the loader kept)
  gguf  run the GGUF blocks the loader kept (`module.gguf_quantized`) natively:
        Q4_0 / Q4_1 / Q8_0 -> Int4Linear (codes.py); other types stay float
  gguf-a8  the same weights times int8 activations quantized on the fly per block
        of 32 (Int4Linear(activations="int8"), vnni.py; llama.cpp's arithmetic) in the
        MLP and the LM head, int16 ones in the attention's qkv_proj and o_proj (config.py's
        GGUF_ATTENTION_ACTIVATIONS: the accuracy gate, docs/accuracy_gate.md), int8 there
        too for Gemma 3 (GGUF_INT8_ATTENTION_ARCHITECTURES: its gate passes with them)
  gguf-a16  the same with int16 activations (two int8 planes, twice the integer
        work, an activation error below bf16's rounding): the default on AVX2.
        With either, each Llama MLP becomes a FusedSiluMLP (fused_mlp.py): silu * up
        inside the down projection's native call, and an MoE file's experts run their
        own records (moe_experts.py)
  int4  quantize float weights, group-32 asymmetric -> Int4Linear
  int8  quantize float weights, per-row symmetric -> Int8Linear
  fp8   e4m3 weights per output channel -> Fp8Linear (fp8.py; CUDA sm_89+), the
        LM head kept in the model's dtype (as vLLM keeps it)

With a bfloat16 model, each quantized linear also keeps the model's own bf16
weight, packed for oneDNN (dense.py), and uses it for inputs of
`dense_min_rows` rows or more, where a bf16 matmul is faster
(benchmarks/kernels/linear_kernels.py). That costs the bf16 weights' memory (~265 MiB
for SmolLM2-135M, its LM head included: the packed copy is not the tied
embedding's tensor). With `dense_min_rows=None`, or a float32 model (fp32
matmuls lose to the bf16 low-bit kernels at every batch measured), the float
weights are freed.

`batched_linears` picks that large-batch weight: "bf16" (the packed bf16 copy),
"w8a8" (int8 per channel x dynamic int8 activations on AVX512-VNNI,
int8_dynamic.py; half the bytes, changed numerics, gated by benchmarks/accuracy.py),
"int16" (gguf-a16 only: the records' own integers widened to int16 for AVX2,
widened.py; the per-row kernel's arithmetic at any batch, no float copy kept), or
"mlp-int8" (gguf-a16 / gguf-a8 on AVX512-VNNI: the MLP's gate_up and down run their
own records on int8 activations, mlp_int8.py, no float copy kept; the attention's
linears and the LM head keep packed bf16; changed numerics, gated by
benchmarks/accuracy.py), or "int8" (the same for the attention's qkv_proj and o_proj
too: every decoder linear on its own records at 8 bits; auto's choice for the
architectures of config.GGUF_INT8_ATTENTION_ARCHITECTURES, whose gate passes it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tokenmill import malloc
from tokenmill.config import ATTENTION_LINEARS, GGUF_ACTIVATIONS, gguf_activations
from tokenmill.cpuinfo import has_native_bf16
from tokenmill.models.deferred_weights import materialize, materialize_all
from tokenmill.models.moe import Experts
from tokenmill.quant import (
    gguf_records,
    gguf_triton,
    huge_pages,
    mlp_int8,
    moe_experts,
    vnni,
    widened,
)
from tokenmill.quant.codes import (
    GGUF_NATIVE_TYPES,
    GROUP_SIZE,
    int4_codes_from_float,
    int8_codes_from_float,
)
from tokenmill.quant.default_arithmetic import default_gguf_arithmetic
from tokenmill.quant.dense import DenseWeight
from tokenmill.quant.embedding import embedding_from_blocks, embedding_from_head
from tokenmill.quant.fp8 import FP8_DIM_MULTIPLE, Fp8Linear, fp8_unavailable_reason
from tokenmill.quant.fused_mlp import FusedSiluMLP
from tokenmill.quant.gguf_records import RECORD_TYPES
from tokenmill.quant.int8_dynamic import K_MULTIPLE as W8A8_K_MULTIPLE
from tokenmill.quant.int8_dynamic import Int8DynamicWeight
from tokenmill.quant.int8_dynamic import available as w8a8_available
from tokenmill.quant.linear import Int4Linear, Int8Linear, QuantizedLinear, gguf_int4_linear

METHODS = ("none", "gguf", "gguf-a8", "gguf-a16", "gguf-triton", "int4", "int8", "fp8")
TARGET_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
# rows from which oneDNN's packed bf16 matmul beats the int4 kernel on the 2-core
# AVX512-BF16 EPYC, quiet. One step's linears (benchmarks/kernels/linear_kernels.py, weights
# from memory): int4 wins at 1-4 rows (15.4 vs 19.9 ms at 4), packed bf16 from 8
# (23.8 vs 28.9 ms). Whole engine decode steps at 200 tokens of context: 4 rows
# int4 29.3 vs packed 33.6 ms, 6 rows 36.4 vs 37.8, 8 rows a tie (41.0 vs 41.6).
DENSE_MIN_ROWS = 8
# gguf-a16 / gguf-a8 (q4q8_gemv.c): rows from which the packed bf16 weights take over
# when the batched linears are bf16. Its kernel costs the same per row at any batch
# (activations quantized per row), so the crossover is where oneDNN's matmul catches
# up. Whole decode steps at 128-token contexts, quiet, 2 threads, VNNI ÷ bf16 step
# time: 0.79 at 8 rows, 0.89 at 12, 0.91 at 16, 1.04 at 24, 1.03 at 31 (BENCHMARKS.md,
# "Batched rows on the VNNI kernel"); 20 lies between the last win and the first loss.
VNNI_DENSE_MIN_ROWS = 20
# the large-batch weight (module docstring); "none": the low-bit kernels at every batch
BATCHED_LINEARS = ("bf16", "w8a8", "int16", "mlp-int8", "int8", "none")
# --batched-linears auto keeps no float copy of a model whose quantized linears' float
# weights would exceed this (issue 56: resident weights about the file's bytes; an 8B
# model's bf16 copy alone is 16 GB)
FLOAT_COPY_LIMIT_BYTES = 1 << 30
# --batched-linears auto's choice where it runs, else packed bf16: mlp-int8 (a GGUF model's
# MLP on its own records at 8-bit activations for large batches too, on AVX512-VNNI) since
# it passed the accuracy gate on all four gated files (docs/accuracy_gate.md); it keeps no
# float copy of the MLP. "bf16" puts packed bf16 back in one line. Where the attention
# runs at int8 in decode as well (config.GGUF_INT8_ATTENTION_ARCHITECTURES), auto takes
# "int8" instead (the attention's linears on their records too): Gemma 3's gate passes it
# (docs/accuracy_gate.md), its mixed prompt-and-decode steps 1.08x faster.
DEFAULT_BATCHED_LINEARS = "mlp-int8"
# the batched-linears choices that run GGUF records at 8 bits (mlp_int8.py)
INT8_RECORD_BATCHES = ("mlp-int8", "int8")
_GGUF_BLOCKS_ATTR = "gguf_quantized"  # where the loader keeps a module's GGUF blocks


@dataclass
class QuantizationSummary:
    method: str
    quantized: list[str] = field(default_factory=list)  # module names now low-bit
    kept_float: dict[str, str] = field(default_factory=dict)  # module name -> why
    lowbit_bytes: int = 0
    dense_bytes: int = 0  # float weights kept only for the large-batch path
    embedding: str = "float"  # the token embedding's form (embedding.py)
    reason: str = ""  # why this method ("gguf-a8: default on AVX-512 VNNI (...)")


def quantize_model(model: nn.Module, method: str,
                   dense_min_rows: int | None | str = "auto",
                   batched_linears: str = "bf16") -> QuantizationSummary:
    """Replace the model's target linears in place; see the module docstring.
    dense_min_rows "auto": VNNI_DENSE_MIN_ROWS for gguf-a16 / gguf-a8 with bf16 or
    int16 batched linears, DENSE_MIN_ROWS otherwise. Q6_K tensors become 8-bit records,
    or 6-bit ones where the model's float copy would pass FLOAT_COPY_LIMIT_BYTES
    (memory that scales, issue 56: gguf_records.Q6_SMALL_FORM)."""
    large = float_copy_bytes(model) > FLOAT_COPY_LIMIT_BYTES
    with gguf_records.small_q6_form(large):
        return _quantize_model(model, method, dense_min_rows, batched_linears)


def _quantize_model(model: nn.Module, method: str, dense_min_rows: int | None | str,
                    batched_linears: str) -> QuantizationSummary:
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; use one of {', '.join(METHODS)}")
    if batched_linears not in BATCHED_LINEARS:
        raise ValueError(f"unknown batched linears {batched_linears!r}; use one of "
                         f"{', '.join(BATCHED_LINEARS)}")
    if batched_linears == "none":
        dense_min_rows = None
    if dense_min_rows == "auto":
        vnni_kernel = GGUF_ACTIVATIONS.get(method) in ("int8", "int16")
        dense_min_rows = (VNNI_DENSE_MIN_ROWS
                          if vnni_kernel and batched_linears in ("bf16", "int16", *INT8_RECORD_BATCHES)
                          else DENSE_MIN_ROWS)
    summary = QuantizationSummary(method)
    freed = 0  # bytes of GGUF blocks freed since the last malloc trim
    if method != "none":
        for name, module in list(model.named_modules()):
            leaf = name.rpartition(".")[2]
            if method == "fp8" and leaf in TARGET_MODULES and leaf != "lm_head":
                if any(d % FP8_DIM_MULTIPLE for d in module.weight.shape):
                    summary.kept_float[name] = (
                        f"fp8: torch._scaled_mm needs both dimensions divisible by "
                        f"{FP8_DIM_MULTIPLE}, not {tuple(module.weight.shape)}")
                    continue
                parent = name.rpartition(".")[0]
                materialize(module.weight)
                fp8 = Fp8Linear(module.weight, getattr(module, "bias", None))
                model.get_submodule(parent).register_module(leaf, fp8)
                summary.quantized.append(name)
                summary.lowbit_bytes += fp8.lowbit_bytes()
            elif method == "gguf-triton" and leaf in TARGET_MODULES:
                # large batches on a float copy (bf16), or on the blocks dequantized
                # each call (none: the weights take the file's bytes)
                gguf_triton.swap_in(model, name, module, summary,
                                    dense_copy=batched_linears != "none")
            elif method != "fp8" and leaf in TARGET_MODULES and not isinstance(
                    module, QuantizedLinear):
                _quantize_one(model, name, module, method, dense_min_rows, summary,
                              batched_linears)
                if module is not model.get_submodule(name):  # replaced: this list still
                    freed += _drop_blocks(module)  # holds it; free its blocks now
                if freed >= huge_pages.TRIM_EVERY_BYTES:  # and the heap pages they held
                    malloc.trim()
                    freed = 0
        if GGUF_ACTIVATIONS.get(method) in ("int8", "int16"):  # MoE experts on records
            moe_experts.swap_in(model, 8 if GGUF_ACTIVATIONS[method] == "int8" else 16,
                                summary)
        else:
            moe_experts.kept_float_reasons(model, summary)
        _fuse_silu_into_down(model)
        _packed_into_huge_pages(model)
        if batched_linears == "int16":  # the int16 records widened (widened.py)
            _records_for_batches(model, dense_min_rows, widened.WidenedWeight,
                                 lambda name, m: m.activations == "int16")
        if batched_linears in INT8_RECORD_BATCHES:  # records at 8 bits (mlp_int8.py)
            leaves = _int8_record_linears(batched_linears)
            _records_for_batches(model, dense_min_rows, mlp_int8.Int8ActivationWeight,
                                 lambda name, m: name.rpartition(".")[2] in leaves)
    if method == "none":  # a GGUF type with no kernel at all is still named (issue 56)
        for name, module in model.named_modules():
            shards = module.__dict__.get(_GGUF_BLOCKS_ATTR)
            if (name.rpartition(".")[2] in TARGET_MODULES and shards
                    and any(s.qtype not in RECORD_TYPES for s in shards)):
                summary.kept_float[name] = _no_native_reason(module, True)
            why = moe_experts.no_records_reason(module) if isinstance(module, Experts) else None
            if why is not None and why.startswith("GGUF type"):
                summary.kept_float[name] = why
    # memory that scales: no float table of the embedding either where no linear keeps a
    # float copy (none; int8, every linear on its records)
    if batched_linears in ("none", "int8") and method in GGUF_ACTIVATIONS:
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        shards = None if embed is None else embed.__dict__.get(_GGUF_BLOCKS_ATTR)
        if embedding_from_head(model, shards):  # tied: the LM head's records, once
            summary.embedding = "the LM head's records (tied), rows read on lookup"
        elif embedding_from_blocks(model, shards):
            summary.embedding = f"{shards[0].qtype.name} blocks, rows dequantized on lookup"
    for module in model.modules():  # the raw blocks are only needed here
        module.__dict__.pop(_GGUF_BLOCKS_ATTR, None)
    materialize_all(model)  # the float weights still in use: linears kept float, norms...
    summary.dense_bytes = dense_copy_bytes(model)
    return summary


def _drop_blocks(module: nn.Module) -> int:
    """Forget a replaced module's GGUF blocks; their bytes."""
    shards = module.__dict__.pop(_GGUF_BLOCKS_ATTR, None) or []
    return sum(s.blocks.numel() for s in shards)


def _packed_into_huge_pages(model: nn.Module) -> None:
    """Every linear's kernel records (vnni_packed) into one huge-page mapping."""
    owners = [m for m in model.modules()
              if isinstance(getattr(m, "vnni_packed", None), torch.Tensor)
              and m.vnni_packed.device.type == "cpu"]
    huge_pages.move_into([(m, "vnni_packed") for m in owners])


def _records_for_batches(model: nn.Module, min_rows: int | None,
                         weight: type[widened.RecordsWeight],
                         takes: Callable[[str, Int4Linear], bool]) -> None:
    """Each linear on the quantized-activation kernel that `takes(name, module)` accepts
    gets `weight` over its own records as its large-batch weight,
    from `min_rows` rows; after the records found their final home."""
    if min_rows is None:
        return
    for name, module in model.named_modules():
        if (isinstance(module, Int4Linear) and module.activations != "bf16"
                and isinstance(getattr(module, "vnni_packed", None), torch.Tensor)
                and takes(name, module)):
            module.dense = weight(module.vnni_packed, module.in_features,
                                  module.out_features, module.vnni_format)
            module.dense_min_rows = min_rows


def dense_copy_bytes(model: nn.Module) -> int:
    """Bytes of the quantized linears' large-batch weights that are not model
    parameters: plain dense weights that still are (a tied embedding) cost nothing
    extra; packed ones are always copies (and gguf-triton's, on the GPU)."""
    params = {p.data_ptr() for p in model.parameters()}
    return sum(m.dense.nbytes for m in model.modules()
               if isinstance(m, QuantizedLinear) and m.dense is not None
               and (m.dense.weight is None or m.dense.weight.data_ptr() not in params)) \
        + sum(m.dense_bytes() for m in model.modules()
              if isinstance(m, gguf_triton.GgufTritonLinear)
              and (m.weight is None or m.weight.data_ptr() not in params))


def _fuse_silu_into_down(model: nn.Module) -> None:
    """Each Llama MLP whose down projection runs the quantized-activation kernel
    becomes a FusedSiluMLP (fused_mlp.py): silu * up inside that kernel's call."""
    from tokenmill.models.llama import LlamaMLP

    for name, module in list(model.named_modules()):
        if (isinstance(module, LlamaMLP) and isinstance(module.down_proj, Int4Linear)
                and module.down_proj.activations != "bf16"):
            parent, _, leaf = name.rpartition(".")
            model.get_submodule(parent).register_module(
                leaf, FusedSiluMLP(module.gate_up_proj, module.down_proj))


def resolve_method(requested: str | None, model: nn.Module,
                   dtype: str | torch.dtype = "auto") -> str:
    """The method to use (`resolve_quantization`'s, without the reason)."""
    return resolve_quantization(requested, model, dtype)[0]


def resolve_quantization(requested: str | None, model: nn.Module,
                         dtype: str | torch.dtype = "auto") -> tuple[str, str]:
    """(method, why): the user's method, else (None or "auto") the per-ISA default for
    GGUF blocks (default_arithmetic.py: gguf-a8 on AVX-512 VNNI, gguf-a16 on AVX2, gguf
    without either) when the loader kept natively runnable GGUF blocks on CPU, unless
    dtype float32 was asked for explicitly (the exact dequantized reference path); float
    checkpoints stay float."""
    if requested not in (None, "auto"):
        if requested not in METHODS:
            raise ValueError(f"unknown quantization {requested!r}; use one of "
                             f"auto, {', '.join(METHODS)}")
        if requested in ("gguf-a8", "gguf-a16") and not vnni.available():
            raise ValueError(f"--quantization {requested}: its native kernel "
                             "(tokenmill/kernels/q4q8_gemv.c) could not be built here")
        if requested == "gguf-triton":
            reason = gguf_triton.unavailable_reason(next(model.parameters()).device)
            if reason is not None:
                raise ValueError(f"--quantization gguf-triton: {reason}")
        if requested == "fp8":
            weight = next(model.parameters())
            reason = fp8_unavailable_reason(weight.device)
            if reason is not None:
                raise ValueError(f"--quantization fp8: {reason}")
            if weight.dtype not in (torch.bfloat16, torch.float16):
                raise ValueError("--quantization fp8 needs a bfloat16 or float16 model "
                                 f"(its output dtype), not {weight.dtype}")
        return requested, f"{requested}: --quantization {requested}"
    if dtype in ("float32", "float", torch.float32):
        return "none", "none: --dtype float32 (the dequantized fp32 reference)"
    if gguf_triton.auto_applies(model, TARGET_MODULES):  # GGUF blocks on a GPU
        return "gguf-triton", "gguf-triton: default for GGUF blocks on a GPU"
    default = default_gguf_arithmetic()
    records = default.method != "gguf"  # the quantized-activation kernel's record types
    for name, module in model.named_modules():
        if records and isinstance(module, Experts) and \
                moe_experts.no_records_reason(module) is None:
            return default.method, default.reason  # an MoE file's experts in records
        if (name.rpartition(".")[2] in TARGET_MODULES and module.weight.device.type == "cpu"
                and _gguf_shards(module, RECORD_TYPES if records else GGUF_NATIVE_TYPES)
                is not None):
            return default.method, default.reason
    return "none", "none: no GGUF blocks a native kernel runs (float weights)"


def _int8_record_linears(batched_linears: str) -> tuple[str, ...]:
    """The linears (leaf names) that run their own records at 8 bits for large batches:
    the MLP's (mlp-int8), every one (int8: the LM head too, whose records ran 20-256
    rows of Gemma 3's 262,144 x 640 head in 0.47-0.71x the time of its packed bf16
    copy on the 2-core Zen 4, and that copy was 320 MiB)."""
    if batched_linears == "int8":
        return mlp_int8.MLP_LINEARS + ATTENTION_LINEARS + ("lm_head",)
    return mlp_int8.MLP_LINEARS


def resolve_batched_linears(requested: str, method: str, dtype: torch.dtype,
                            native_bf16: bool | None = None,
                            float_copy: int | None = None,
                            architecture: str | None = None) -> str:
    """The large-batch weight for `--batched-linears` (auto | bf16 | w8a8 | int16 |
    mlp-int8 | int8 | none): auto is none where the float copy (`float_copy` bytes, see
    `float_copy_bytes`) would exceed FLOAT_COPY_LIMIT_BYTES, int16 for gguf-a16 on an
    AVX2 CPU without native bf16, else DEFAULT_BATCHED_LINEARS where it runs (mlp-int8:
    gguf-a8 / gguf-a16 on AVX512-VNNI; int8 for gguf-a8 on an `architecture` of
    GGUF_INT8_ATTENTION_ARCHITECTURES), else bf16 (`native_bf16`: whether this CPU
    has it, default cpuinfo's answer). An explicit choice that cannot run here is an
    error naming the flag."""
    choices = ("auto", *BATCHED_LINEARS)
    if requested not in choices:
        raise ValueError(f"--batched-linears {requested!r}: use one of {', '.join(choices)}")
    runs_here = dtype == torch.bfloat16 and method in (*GGUF_ACTIVATIONS, "int4", "int8")
    if requested == "w8a8" and not runs_here:
        raise ValueError("--batched-linears w8a8 replaces the bf16 large-batch weights of "
                         "low-bit linears: it needs a bfloat16 model with --quantization "
                         f"gguf, gguf-a8, gguf-a16, int4 or int8 (here {dtype}, {method})")
    if requested == "w8a8" and not w8a8_available():
        raise ValueError("--batched-linears w8a8 needs the native int8 kernel: a C "
                         "compiler and a CPU with AVX512-VNNI")
    if requested == "int16" and method != "gguf-a16":
        raise ValueError("--batched-linears int16 widens the gguf-a16 kernel's own weights: "
                         f"it needs --quantization gguf-a16 (here {method})")
    if requested == "int16" and not widened.available():
        raise ValueError("--batched-linears int16 needs the native kernel built with AVX2 "
                         "and without AVX512-VNNI (where packed bf16 is faster)")
    if requested in INT8_RECORD_BATCHES and method not in ("gguf-a8", "gguf-a16"):
        what = "MLP's" if requested == "mlp-int8" else "linears'"
        raise ValueError(f"--batched-linears {requested} runs the {what} GGUF records on "
                         "int8 activations: it needs --quantization gguf-a16 or gguf-a8 "
                         f"(here {method})")
    if requested in INT8_RECORD_BATCHES and not mlp_int8.available():
        raise ValueError(f"--batched-linears {requested} needs the native kernel built "
                         "with AVX512-VNNI (q4q8_gemv.c)")
    if requested == "auto" and float_copy is not None and float_copy > FLOAT_COPY_LIMIT_BYTES \
            and method in (*GGUF_ACTIVATIONS, "int4", "int8", "gguf-triton"):
        return "none"  # memory that scales: no float copy (an explicit bf16 keeps one)
    if requested == "auto":
        native = has_native_bf16() if native_bf16 is None else native_bf16
        if method == "gguf-a16" and widened.available() and not native:
            return "int16"  # oneDNN's large-batch weight would be fp32 here (dense.py)
        default = DEFAULT_BATCHED_LINEARS
        if default == "mlp-int8" and method in ("gguf-a8", "gguf-a16") \
                and dtype == torch.bfloat16 and mlp_int8.available():
            if gguf_activations(method, ATTENTION_LINEARS[0], architecture) == "int8":
                return "int8"  # the attention takes int8 in decode too (config.py)
            return default
        if default == "w8a8" and runs_here and w8a8_available():
            return default
        return "bf16"
    return requested


def _quantize_one(model: nn.Module, name: str, module: nn.Module, method: str,
                  dense_min_rows: int | None, summary: QuantizationSummary,
                  batched_linears: str = "bf16") -> None:
    weight: torch.Tensor = module.weight
    bias: torch.Tensor | None = getattr(module, "bias", None)
    if weight.device.type != "cpu":
        materialize(weight)
        summary.kept_float[name] = f"on {weight.device.type}; the low-bit kernels are CPU only"
        return
    # int16 and mlp-int8: the records themselves, after (_records_for_batches)
    on_records = batched_linears == "int16" or (
        batched_linears in INT8_RECORD_BATCHES
        and name.rpartition(".")[2] in _int8_record_linears(batched_linears))
    keep_dense = (dense_min_rows is not None and weight.dtype == torch.bfloat16
                  and not on_records)
    if keep_dense or method not in GGUF_ACTIVATIONS:  # the float values are read here
        materialize(weight)

    dense: torch.Tensor | Int8DynamicWeight | None = weight if keep_dense else None
    if keep_dense and batched_linears == "w8a8" and weight.shape[1] % W8A8_K_MULTIPLE == 0:
        dense = Int8DynamicWeight(weight)
    new: QuantizedLinear
    if method in GGUF_ACTIVATIONS:
        on_kernel = GGUF_ACTIVATIONS[method] != "bf16"
        shards = _gguf_shards(module, RECORD_TYPES if on_kernel else GGUF_NATIVE_TYPES)
        if shards is None:
            materialize(weight)
            summary.kept_float[name] = _no_native_reason(module, on_kernel)
            return
        architecture = getattr(getattr(model, "config", None), "architecture", None)
        new = gguf_int4_linear(shards, bias, dense, dense_min_rows,
                               gguf_activations(method, name.rpartition(".")[2], architecture))
        new.gguf_types = "+".join(sorted({s.qtype.name for s in shards}))
    elif weight.shape[1] % GROUP_SIZE and method == "int4":
        summary.kept_float[name] = f"in_features not a multiple of {GROUP_SIZE}"
        return
    elif method == "int4":
        new = Int4Linear(*int4_codes_from_float(weight), bias=bias, dense_weight=dense,
                         dense_min_rows=dense_min_rows)
    else:
        new = Int8Linear(*int8_codes_from_float(weight), bias=bias, dense_weight=dense,
                         dense_min_rows=dense_min_rows)
    if (on_records and dense_min_rows is not None and weight.dtype == torch.bfloat16
            and not (isinstance(new, Int4Linear) and new.activations
                     in (("int16",) if batched_linears == "int16" else ("int8", "int16")))):
        # not on the kernel (no exact record form): the float weight, as for bf16
        materialize(weight)
        new.dense, new.dense_min_rows = DenseWeight(weight), dense_min_rows
    parent, _, leaf = name.rpartition(".")
    model.get_submodule(parent).register_module(leaf, new)
    summary.quantized.append(name)
    summary.lowbit_bytes += new.lowbit_bytes()


def _no_native_reason(module: nn.Module, on_kernel: bool) -> str:
    """Why a GGUF linear stays float, naming its blocks' types (the start-up log shows it)."""
    shards = module.__dict__.get(_GGUF_BLOCKS_ATTR)
    if not shards:
        return "no quantized GGUF blocks from the loader"
    names = ", ".join(sorted({s.qtype.name for s in shards}))
    if on_kernel:
        return f"GGUF type {names} has no native kernel: dequantized"
    return f"GGUF type {names}: only Q4_0/Q4_1/Q8_0 run without int8/int16 activations"


def float_copy_bytes(model: nn.Module) -> int:
    """Bytes a bf16 copy of the target linears' weights would take (the large-batch
    weight `--batched-linears bf16` keeps)."""
    return sum(2 * m.weight.numel() for name, m in model.named_modules()
               if name.rpartition(".")[2] in TARGET_MODULES
               and isinstance(getattr(m, "weight", None), torch.Tensor))


def _gguf_shards(module: nn.Module, types: Any = GGUF_NATIVE_TYPES) -> list[Any] | None:
    """The loader's blocks for this module, if they cover its weight's rows in order
    with `types` (the int4 kernel's Q4_0, Q4_1, Q8_0, or gguf_records.RECORD_TYPES)."""
    shards = module.__dict__.get(_GGUF_BLOCKS_ATTR)
    if not shards:
        return None
    out_features, in_features = module.weight.shape
    row = 0
    for s in shards:
        if (s.qtype not in types or s.row_offset != row
                or s.shape[1] != in_features or in_features % GROUP_SIZE):
            return None
        row += s.shape[0]
    return list(shards) if row == out_features else None
