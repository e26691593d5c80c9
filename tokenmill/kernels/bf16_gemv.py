"""bf16 linears for the rows of a decode step, up to 48 (bf16_gemv.c).

`linear` returns None when the kernel is not built or does not take the tensors
(not bf16 on the CPU, more than `max_rows()` rows); the caller then runs F.linear,
which computes the same sums in another order.
"""

from __future__ import annotations

import ctypes

import torch

from tokenmill.kernels.build import Library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_lib = Library("bf16_gemv", {
    "tm_bf16_gemv_max_rows": ([], _I64),
    "tm_bf16_gemv": ([_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64], _I64),
})


def available() -> bool:
    return _lib.get("tm_bf16_gemv") is not None


def max_rows() -> int:
    """The most rows a call takes (0 when the kernel is not built)."""
    fn = _lib.get("tm_bf16_gemv_max_rows")
    return fn() if fn is not None else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor | None:
    """F.linear(x, weight, bias) for bf16 CPU tensors with at most max_rows() rows of x
    (..., K); None if not taken."""
    fn = _lib.get("tm_bf16_gemv")
    if (fn is None or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or x.device.type != "cpu" or weight.device.type != "cpu" or weight.dim() != 2
            or not weight.is_contiguous() or x.dim() < 1 or x.shape[-1] != weight.shape[1]
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()
                                      or bias.shape != (weight.shape[0],)))):
        return None
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    if not 1 <= rows <= max_rows():
        return None
    x2d = x.reshape(rows, k).contiguous()
    y = torch.empty((rows, n), dtype=torch.bfloat16)
    rc = fn(x2d.data_ptr(), rows, k, weight.data_ptr(), n,
            None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y.view(*x.shape[:-1], n) if rc == 0 else None
