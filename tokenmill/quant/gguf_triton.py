"""GGUF linears on the GPU: decode batches read the file's blocks (Q8_0, Q4_0, Q4_K,
Q6_K) through triton_gguf_gemm, dequantized in registers, instead of the bf16 weight
the loader dequantized to. A Q4_K_M decode step then reads ~4.5-6.5 bits a weight
instead of 16.

Larger batches (prefill, more than triton_gguf_gemm.MAX_ROWS rows) are compute-bound
and run cuBLAS on the dense weight: either a bf16 copy kept resident
(`--batched-linears bf16`, and `auto` where the copy stays under
FLOAT_COPY_LIMIT_BYTES), or, with no copy (`none`, and `auto` above that), the
blocks dequantized into a scratch weight each call (triton_gguf_gemm.dequantize:
one read of the blocks and one write of the dense bytes a linear, which the torch
allocator's cache hands from one linear to the next), as vLLM's GGUF path does
for large batches. Then the weights take the file's bytes on the GPU, not the
file's plus bf16's.

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
    """y = x W^T (+ b): W's GGUF blocks at up to MAX_ROWS rows; above, a matmul on its
    dense copy, or with none kept (weight None) on the blocks dequantized for the call."""

    def __init__(self, shards: Sequence[Any], weight: torch.Tensor | None,
                 bias: torch.Tensor | None = None, *, shape: tuple[int, int] | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | None = None
                 ) -> None:
        """weight: the dense copy for large batches, or None with shape (out, in), the
        compute dtype and device given instead."""
        super().__init__()
        if weight is not None:
            shape, dtype, device = weight.shape, weight.dtype, weight.device
        assert shape is not None and dtype is not None and device is not None
        self.out_features, self.in_features = shape
        self.dtype = dtype
        self.weight = None if weight is None else weight.detach()  # (module docstring)
        self.bias = None if bias is None else bias.detach()
        runs: list[tuple[str, list[torch.Tensor]]] = []
        for s in shards:
            name = s.qtype.name
            if runs and runs[-1][0] == name:
                runs[-1][1].append(s.blocks)
            else:
                runs.append((name, [s.blocks]))
        self.runs = [(name, torch.cat(blocks).to(device).contiguous())
                     for name, blocks in runs]
        self.gguf_types = "+".join(dict.fromkeys(name for name, _ in self.runs))

    def lowbit_bytes(self) -> int:
        return sum(blocks.numel() for _, blocks in self.runs)

    def dense_bytes(self) -> int:
        return 0 if self.weight is None else self.weight.nbytes

    def dense_weight(self) -> torch.Tensor:
        """The (out, in) weight in the compute dtype: the copy, or dequantized now."""
        if self.weight is not None:
            return self.weight
        from tokenmill.kernels import triton_gguf_gemm

        w = torch.empty((self.out_features, self.in_features), dtype=self.dtype,
                        device=self.runs[0][1].device)
        row = 0
        for name, blocks in self.runs:
            rows = blocks.shape[0]
            if not triton_gguf_gemm.dequantize(blocks, name, self.in_features,
                                               w[row:row + rows]):
                raise RuntimeError(f"gguf-triton: cannot dequantize {name} blocks "
                                   f"{tuple(blocks.shape)} for K={self.in_features}")
            row += rows
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tokenmill.kernels import triton_gguf_gemm

        x2d = x.reshape(-1, self.in_features)  # (M, K)
        parts = [triton_gguf_gemm.gguf_gemm(x2d, blocks, name, self.in_features)
                 for name, blocks in self.runs]
        if any(p is None for p in parts):  # more rows than a decode batch
            y = x2d @ self.dense_weight().t()
        else:
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def swap_in(model: nn.Module, name: str, module: nn.Module, summary: Any,
            dense_copy: bool = True) -> None:
    """Replace `module` (model's `name`) by a GgufTritonLinear where the loader kept blocks
    the kernel reads, with its float weight as the large-batch copy if `dense_copy`
    (materialized then), else none; else record in `summary.kept_float` why not (the
    float weight then materialized, as the linear runs on it)."""
    from tokenmill.models.deferred_weights import materialize

    shards = module.__dict__.get("gguf_quantized")
    out_features, in_features = module.weight.shape
    if not runnable(shards, in_features, out_features):
        types = sorted({s.qtype.name for s in shards or []})
        summary.kept_float[name] = (f"GGUF types {types or 'none'} (the kernel reads "
                                    f"{', '.join(TYPES)})")
        materialize(module.weight)
        return
    bias = getattr(module, "bias", None)
    tied = any(p is module.weight for n, p in model.named_parameters(remove_duplicate=False)
               if not n.startswith(f"{name}."))  # a tied embedding's table: resident anyway
    if dense_copy or tied:
        materialize(module.weight)
        new = GgufTritonLinear(shards, module.weight, bias)
    else:  # the float weight is never filled (a deferred parameter) or dropped
        new = GgufTritonLinear(shards, None, bias, shape=(out_features, in_features),
                               dtype=module.weight.dtype, device=module.weight.device)
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
