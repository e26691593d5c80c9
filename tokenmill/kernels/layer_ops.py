"""Fused per-layer steps: for bf16 activations on the CPU (layer_ops.c), and for
CUDA tensors of any dtype as Triton kernels (triton_layer_ops.py, and for a decode
batch's linears with the norm or SiLU * up before them, triton_decode_linear.py;
imported on first use: importing tokenmill does not import triton).

Each function returns None (or False) when the kernel is not built or does
not take the tensors (not bf16 on the CPU, triton missing, not laid out as it
needs); the caller then runs its plain torch ops, which compute the same values.
"""

from __future__ import annotations

import ctypes
import functools
from types import ModuleType

import torch

from tokenmill.kernels.build import Library

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_lib = Library("layer_ops", {
    "tm_rms_norm_bf16": ([_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _I64], None),
    "tm_rotary_bf16": ([_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64], None),
    "tm_silu_mul_bf16": ([_PTR, _PTR, _I64, _I64, _I64], None),
    "tm_gelu_tanh_mul_bf16": ([_PTR, _PTR, _I64, _I64, _I64], None),
    "tm_argmax_f32": ([_PTR, _I64, _I64, _PTR, _I64], None),
    "tm_sample_f32": ([_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64], None),
})


@functools.cache
def triton_ops() -> ModuleType | None:
    """triton_layer_ops for CUDA tensors; None where triton is not installed."""
    try:
        from tokenmill.kernels import triton_layer_ops
    except ImportError:
        return None
    return triton_layer_ops


@functools.cache
def num_sms(device: torch.device) -> int:
    """A CUDA device's SM count, which the Triton kernels size their grids by."""
    return torch.cuda.get_device_properties(device).multi_processor_count


# off: a CUDA decode batch's norms, SiLU * up and linears as separate kernels, the
# linears on cuBLAS (gpu_check.py's A/B of triton_decode_linear)
FUSED_DECODE_LINEARS = True


@functools.cache
def _decode_linear_module() -> ModuleType | None:
    try:
        from tokenmill.kernels import triton_decode_linear
    except ImportError:
        return None
    return triton_decode_linear


def decode_linears(x: torch.Tensor) -> ModuleType | None:
    """triton_decode_linear for CUDA activations (its functions return None for
    batches too large); None on the CPU, where triton is missing, or switched off."""
    if not FUSED_DECODE_LINEARS or not x.is_cuda:
        return None
    return _decode_linear_module()


def _takes(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)


def available() -> bool:
    return _lib.get("tm_rms_norm_bf16") is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """weight * norm(x), or with a residual: residual <- x + residual (in place) and
    the norm of that, written over x. None if the kernel does not take the inputs."""
    if x.is_cuda:
        ops = triton_ops()
        return None if ops is None else ops.rms_norm(x, weight, eps, residual)
    fn = _lib.get("tm_rms_norm_bf16")
    if (fn is None or not _takes(x, weight) or not x.is_contiguous()
            or residual is not None and (not _takes(residual) or not residual.is_contiguous()
                                         or residual.shape != x.shape)):
        return None
    hidden = x.shape[-1]
    out = x if residual is not None else torch.empty_like(x)
    fn(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
       out.data_ptr(), x.numel() // hidden, hidden, eps, torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> bool:
    """Rotate x (T, heads, D) in place at `positions` (T,) int64 with fp32 tables
    (max_pos, D). False (x untouched) if the kernel does not take the inputs."""
    if x.is_cuda:
        ops = triton_ops()
        return ops is not None and ops.rotary_(x, positions, cos, sin)
    fn = _lib.get("tm_rotary_bf16")
    tokens, heads, d = x.shape
    if (fn is None or not _takes(x) or x.stride(2) != 1 or x.stride(1) != d or d > 1024
            or d % 2 or positions.dtype != torch.int64 or not positions.is_contiguous()
            or cos.dtype != torch.float32 or not cos.is_contiguous()
            or not sin.is_contiguous() or positions.device.type != "cpu"):
        return False
    fn(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, d,
       x.stride(0), torch.get_num_threads())
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up (..., 2 * inter) = [gate | up]; None if not taken."""
    if gate_up.is_cuda:
        ops = triton_ops()
        return None if ops is None else ops.silu_mul(gate_up)
    fn = _lib.get("tm_silu_mul_bf16")
    if fn is None or not _takes(gate_up) or not gate_up.is_contiguous():
        return None
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    fn(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter,
       torch.get_num_threads())
    return out


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gelu(gate, approximate="tanh") * up for bf16 gate_up (..., 2 * inter) = [gate | up]
    on the CPU (Gemma's GeGLU, the fused decode step's own rows); None if not taken."""
    fn = _lib.get("tm_gelu_tanh_mul_bf16")
    if fn is None or gate_up.is_cuda or not _takes(gate_up) or not gate_up.is_contiguous():
        return None
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    fn(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter,
       torch.get_num_threads())
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(logits, dim=-1) for fp32 logits (N, V) on the CPU, the same indices
    (the first of equal maxima, NaN as the largest); None if not taken."""
    fn = _lib.get("tm_argmax_f32")
    if (fn is None or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or logits.dim() != 2 or not logits.is_contiguous() or logits.shape[1] == 0):
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    fn(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(),
       torch.get_num_threads())
    return out


def sample(logits: torch.Tensor, temperatures: list[float], uniforms: torch.Tensor
           ) -> torch.Tensor | None:
    """One token a row of fp32 logits (N, V) on the CPU, drawn from
    softmax(logits / temperature) with each row's U[0, 1) draw, as
    sampling_ops.inverse_cdf_draw draws from torch.softmax (the same draw but for the
    rounding of the sums) in two passes over the logits instead of torch's five; the
    logits are not written. None if not taken (then torch's path runs): not fp32 on the
    CPU, or a row with a NaN, +inf or no finite logit."""
    fn = _lib.get("tm_sample_f32")
    if (fn is None or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or logits.dim() != 2 or not logits.is_contiguous() or logits.shape[1] == 0):
        return None
    n = logits.shape[0]
    temps = torch.tensor(temperatures, dtype=torch.float32)
    u = uniforms.to(torch.float32).contiguous()
    out = torch.empty(n, dtype=torch.int64)
    fn(logits.data_ptr(), n, logits.shape[1], temps.data_ptr(), u.data_ptr(), out.data_ptr(),
       torch.get_num_threads())
    return None if bool((out < 0).any()) else out
