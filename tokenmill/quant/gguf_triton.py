"""GGUF linears on the GPU: decode batches read the file's blocks (Q8_0, Q4_0, Q4_K,
Q6_K) through triton_gguf_gemm, dequantized in registers, instead of the bf16 weight
the loader dequantized to. A Q4_K_M decode step then reads ~4.5-6.5 bits a weight
instead of 16.

Larger batches (prefill, more than triton_gguf_gemm.MAX_ROWS rows) are compute-bound
and keep the dense weight's cuBLAS matmul, so the bf16 weight stays resident too:
this saves bandwidth, not memory (yet).

A fused module (qkv, gate_up) may hold shards of different types (Q4_K_M writes some
v projections as Q6_K): consecutive shards of one type are concatenated into one
launch, and the outputs of the launches are concatenated along N.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")


def runnable(shards: Sequence[Any] | None, in_features: int, out_features: int) -> bool:
    """Whether the loader's shards cover the weight's rows in order, in types the kernel reads."""
    if not shards:
        return False
    row = 0
    for s in shards:
        if s.qtype.name not in TYPES or s.row_offset != row or s.shape[1] != in_features:
            return False
        row += s.shape[0]
    return row == out_features


class GgufTritonLinear(nn.Module):
    """y = x W^T (+ b): W's GGUF blocks at up to MAX_ROWS rows, its dense copy above."""

    def __init__(self, shards: Sequence[Any], weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach()  # the large-batch path (module docstring)
        self.bias = None if bias is None else bias.detach()
        runs: list[tuple[str, list[torch.Tensor]]] = []
        for s in shards:
            name = s.qtype.name
            if runs and runs[-1][0] == name:
                runs[-1][1].append(s.blocks)
            else:
                runs.append((name, [s.blocks]))
        self.runs = [(name, torch.cat(blocks).to(weight.device).contiguous())
                     for name, blocks in runs]

    def lowbit_bytes(self) -> int:
        return sum(blocks.numel() for _, blocks in self.runs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tokenmill.kernels import triton_gguf_gemm

        x2d = x.reshape(-1, self.in_features)  # (M, K)
        parts = [triton_gguf_gemm.gguf_gemm(x2d, blocks, name, self.in_features)
                 for name, blocks in self.runs]
        if any(p is None for p in parts):  # more rows than a decode batch
            y = x2d @ self.weight.t()
        else:
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def swap_in(model: nn.Module, name: str, module: nn.Module, summary: Any) -> None:
    """Replace `module` (model's `name`) by a GgufTritonLinear where the loader kept blocks
    the kernel reads; else record in `summary.kept_float` why not."""
    shards = module.__dict__.get("gguf_quantized")
    out_features, in_features = module.weight.shape
    if not runnable(shards, in_features, out_features):
        types = sorted({s.qtype.name for s in shards or []})
        summary.kept_float[name] = (f"GGUF types {types or 'none'} (the kernel reads "
                                    f"{', '.join(TYPES)})")
        return
    new = GgufTritonLinear(shards, module.weight, getattr(module, "bias", None))
    parent, _, leaf = name.rpartition(".")
    model.get_submodule(parent).register_module(leaf, new)
    summary.quantized.append(name)
    summary.lowbit_bytes += new.lowbit_bytes()


def auto_applies(model: nn.Module, target_modules: Sequence[str]) -> bool:
    """Whether --quantization auto picks gguf-triton: a model on CUDA, with triton, whose
    loader kept blocks the kernel reads for at least one target linear."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False
    return any(name.rpartition(".")[2] in target_modules
               and module.weight.device.type == "cuda"
               and runnable(module.__dict__.get("gguf_quantized"), module.weight.shape[1],
                            module.weight.shape[0])
               for name, module in model.named_modules())


def unavailable_reason(device: torch.device) -> str | None:
    """None when the kernel runs on `device` (CUDA, or anywhere under TRITON_INTERPRET=1)."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        return "needs triton (pip install triton)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"its triton kernel runs on CUDA GPUs, not {device.type} (on CPU use gguf, "
                "gguf-a8 or gguf-a16)")
    return None
