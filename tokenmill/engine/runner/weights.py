"""Load the model the engine runs: pick the compute dtype and weight format.

Users do not tune flags, so `dtype="auto"` with no `--quantization` picks the
fastest correct path for the machine: a GGUF's blocks run natively in bf16 where the
CPU has native bf16 (AVX512-BF16 or AMX) or SIMD integer dot products for the
quantized-activation kernel, activations quantized on the fly from bf16 (`gguf-a8` on
AVX512-VNNI, `gguf-a16` on AVX2: quant/default_arithmetic.py, which says why); else
torch's int4 kernel on bf16 activations, `gguf`. Large batches take dense weights where a matmul wins (quant/model.py);
elsewhere float weights. An explicit `dtype="float32"` keeps the exact dequantized
fp32 reference path.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from tokenmill.cpuinfo import has_native_bf16
from tokenmill.engine.runner.heap_trim import trim_heap
from tokenmill.loaders import LoadedModel, ModelSource, load_model, resolve_dtype
from tokenmill.loaders.gguf import release_gguf_readers
from tokenmill.quant import quantize_model, vnni
from tokenmill.quant.model import float_copy_bytes, resolve_batched_linears, resolve_quantization
from tokenmill.quant.weight_report import log_report, weight_report
from tokenmill.startup_timer import mark

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _one_thread(device: torch.device) -> Iterator[None]:
    """Load on one CPU thread. `tokenmill serve`'s front end starts (then torch, FastAPI,
    the tokenizer) while the core loads, so the load's many small torch ops had one core
    at best; a second OpenMP thread then spun at every op's barrier for a core it did not
    get: 2.5x the CPU time of the same load on one thread (issue 60, measured under
    load). The threads the engine runs with are back once the weights are packed.
    The front end no longer imports torch and is idle from ~1 s on, but one thread is
    still the faster load on an idle machine: `benchmarks/startup.py` on the quiet 2-core
    Zen 4 (2026-12-06), the packing phase on one thread 1.5-1.9 s, on two 5.3-5.8 s
    (weights read and packing both on two: 4.5-5.7 s)."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def cpu_has_native_bf16() -> bool:
    return has_native_bf16()


def compute_dtype(requested: str, source: ModelSource, device: torch.device) -> torch.dtype:
    if requested == "auto" and source.kind == "gguf" and (
            device.type == "cuda" or cpu_has_native_bf16() or vnni.fast()):
        return torch.bfloat16
    return resolve_dtype(requested, source, device)


def load_engine_model(source: ModelSource, dtype: str, quantization: str | None,
                      device: torch.device, load_format: str = "auto",
                      batched_linears: str = "auto") -> tuple[LoadedModel, str]:
    """The loaded model and the weight format it runs (a `tokenmill.quant` method)."""
    # quantized linears' float weights are filled only where used (deferred_weights.py):
    # a ~1B Q4_K_M file peaked at 4.8 GB dequantizing them all, for 1.2 GB resident after
    with _one_thread(device):
        loaded = load_model(source, dtype=compute_dtype(dtype, source, device), device=device,
                            load_format=load_format, defer_quantized=True)
        mark("weights read")
        method, why = resolve_quantization(quantization, loaded.model, dtype)
        float_copy = float_copy_bytes(loaded.model)
        large = resolve_batched_linears(batched_linears, method, loaded.dtype,
                                        cpu_has_native_bf16(), float_copy,
                                        loaded.config.architecture)
        summary = quantize_model(loaded.model, method, batched_linears=large)
        summary.reason = why  # the start-up log, /server_info and explain say it
        mark(f"linears packed as {method} (kernel cache checked)")
    if source.kind == "gguf":  # every weight is copied out: unmap the file's tensor pages
        release_gguf_readers()
    trim_heap()  # the load's freed temporaries (blocks, repack buffers) back to the OS
    # what the weights occupy and in which form: logged, and on /server_info
    loaded.model.weight_forms = weight_report(loaded.model, summary, large, float_copy)
    log_report(loaded.model.weight_forms)
    return loaded, method
