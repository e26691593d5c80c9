"""The dense bf16 weight a quantized linear uses for large batches, in oneDNN's own layout.

`F.linear` hands oneDNN a plain (N, K) weight and oneDNN reorders it into its
blocked layout on every call; reordering once at load (what inductor's
freezing pass does) makes the same matmul 1.2-2x faster on the 2-core
AVX512-BF16 EPYC (benchmarks/linear_kernels.py, `bf16_packed`), with identical
results. Where torch has no oneDNN (or the op fails), the plain weight is kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_PACK_BATCH_HINT = 16  # oneDNN picks its layout for this many rows; 1-64 measured alike


class DenseWeight:
    """y = x W^T for a bf16 CPU weight W (N, K), packed for oneDNN when possible."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = _pack(weight.detach())
        # the plain weight only when packing failed (it may be the tied embedding's tensor)
        self.weight = weight.detach() if self.packed is None else None

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 2

    def __call__(self, x2d: torch.Tensor) -> torch.Tensor:
        """x2d: (M, K) bf16 -> (M, N) bf16."""
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x2d, self.packed, None, "none", [], "")
        return F.linear(x2d, self.weight)  # type: ignore[arg-type]


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        probe = torch.ones(1, weight.shape[1], dtype=torch.bfloat16)
        y = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return None  # a torch without these ops, or a CPU oneDNN cannot run bf16 on
    return packed if y.shape == (1, weight.shape[0]) else None
