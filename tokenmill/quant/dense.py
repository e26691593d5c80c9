"""The dense weight a quantized linear uses for large batches, in oneDNN's own layout.

`F.linear` hands oneDNN a plain (N, K) weight and oneDNN reorders it into its
blocked layout on every call; reordering once at load (what inductor's
freezing pass does) makes the same matmul 1.2-2x faster on the 2-core
AVX512-BF16 EPYC (benchmarks/kernels/linear_kernels.py, `bf16_packed`), with identical
results. Where torch has no oneDNN (or the op fails), the plain weight is kept.

On a CPU without native bf16 (no AVX512-BF16 or AMX: AVX2 machines) oneDNN's bf16
matmul is emulated and 3-4x slower than fp32 (one layer's linears at 128 rows on a
2-core AVX2 EPYC: 14.3 vs 4.3 ms unpacked, 1.9 ms packed), so the weight is kept in
fp32 there: the bf16 input is widened exactly, the product accumulates in fp32 as
oneDNN's bf16 matmul does, and the output is rounded to bf16. Twice the memory of the
bf16 copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.cpuinfo import has_native_bf16

_PACK_BATCH_HINT = 16  # oneDNN picks its layout for this many rows; 1-64 measured alike


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype DenseWeight keeps `weight` (bf16) in: fp32 on a CPU without native bf16."""
    return (torch.float32 if weight.device.type == "cpu" and not has_native_bf16()
            else weight.dtype)


class DenseWeight:
    """y = x W^T for a bf16 CPU weight W (N, K), packed for oneDNN when possible; kept
    in `dtype` (default: compute_dtype(W))."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype or compute_dtype(weight)
        w = weight.detach().to(self.dtype)
        self.packed = _pack(w)
        # the plain weight only when packing failed (it may be the tied embedding's tensor)
        self.weight = w if self.packed is None else None

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize

    def __call__(self, x2d: torch.Tensor, out_dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
        """x2d: (M, K) bf16 -> (M, N) in out_dtype (default x2d's)."""
        out_dtype = out_dtype or x2d.dtype
        x = x2d.to(self.dtype)
        if self.packed is not None:
            m = x.shape[0]
            rows = bucket_rows(m)
            if rows != m:  # zero rows: their outputs are dropped, the others' unchanged
                x = torch.cat([x, x.new_zeros(rows - m, x.shape[1])])
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")[:m]
        else:
            y = F.linear(x, self.weight)  # type: ignore[arg-type]
        return y.to(out_dtype)


def bucket_rows(m: int) -> int:
    """The row count a packed matmul of `m` rows runs at: a multiple of 8 up to 64 rows,
    of 16 up to 512, of 64 above. oneDNN compiles a primitive, ~1-2 MiB of code, per
    exact shape, and a step's shape is its token count: buckets let a server's steps
    reuse a few dozen shapes instead of compiling one for nearly every prefill
    (engine/runner/onednn_caches.py), at the price of at most 7 / 15 / 63 zero rows
    (<= 28% more rows from 20 rows on, <= 12% past 512). Rows are independent in oneDNN's
    matmul: the real rows' outputs are the same bits, bf16 and fp32, on the AVX-512
    machine (tests/model/test_dense_buckets.py)."""
    step = 8 if m <= 64 else 16 if m <= 512 else 64
    return -(-m // step) * step


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    if (weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32)
            or not torch.backends.mkldnn.is_available()):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        probe = torch.ones(1, weight.shape[1], dtype=weight.dtype)
        y = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return None  # a torch without these ops, or a CPU oneDNN cannot run bf16 on
    return packed if y.shape == (1, weight.shape[0]) else None
