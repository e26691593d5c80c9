"""A grammar's packed token bitmask applied to fp32 CPU logits (token_bitmask.c).

`apply_` returns False (logits untouched) when the kernel is not built or does not
take the tensors; the caller then uses xgrammar's own kernel."""

from __future__ import annotations

import ctypes

import torch

from tokenmill.kernels.build import Library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_lib = Library("token_bitmask", {
    "tm_apply_token_bitmask_f32": ([_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64], None),
})


def apply_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> bool:
    """logits (N, V) float32 on the CPU, rows contiguous; bitmask (N, ceil(V/32)) int32:
    for each of `rows`, the disallowed tokens' logits become -inf, in place."""
    fn = _lib.get("tm_apply_token_bitmask_f32")
    if (fn is None or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or logits.dim() != 2 or logits.stride(1) != 1 or bitmask.dtype != torch.int32
            or bitmask.device.type != "cpu" or not bitmask.is_contiguous()
            or bitmask.shape[0] != logits.shape[0]
            or bitmask.shape[1] * 32 < logits.shape[1]):
        return False
    index = torch.tensor(rows, dtype=torch.int64)
    fn(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.shape[1],
       index.data_ptr(), len(rows), logits.shape[1])
    return True
