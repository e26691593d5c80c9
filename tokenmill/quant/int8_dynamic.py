"""int8 weights x dynamic int8 activations for the batched linears (issue 21): "w8a8".

At 8+ rows a quantized linear runs its large-batch weight (linear.py's `dense`); by
default that is the model's bf16 weight packed for oneDNN (dense.py). This is the
other choice: the same weight rounded once to int8, symmetric per output channel,
against activations rounded per row (token) to unsigned 8 bits with their own scale
and zero point, multiplied on AVX512-VNNI by tokenmill/kernels/int8_gemm.c. It reads
half the bytes of bf16 and VNNI does twice the multiply-adds per instruction of
AVX512-BF16.

Numerics: the integer sums are exact, so the error against the bf16 matmul is the
two roundings to 8 bits: per element at most half a step of the weight's row
(max |w| / 254) and of the activation row ((max - min) / 510), then fp32 scaling and
one bf16 rounding. `reference` computes the same result in torch (fp64 over the same
codes): the kernel equals it within one bf16 rounding (tests/model/test_int8_gemm.py).
Activation rounding changes a model's numerics, so the path is gated by
benchmarks/accuracy.py (issue 21: within 1% perplexity of bf16, >= 97% top-1
agreement with fp32); the fp32 reference path (--dtype float32) never uses it.
"""

from __future__ import annotations

import ctypes

import torch

from tokenmill.kernels.build import Library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_lib = Library("int8_gemm", {
    "tm_int8_gemm_available": ([], ctypes.c_int),
    "tm_int8_pack_weight": ([_PTR, _I64, _I64, _PTR, _PTR], None),
    "tm_int8_gemm_bf16": ([_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR,
                           _I64], ctypes.c_int),
})
K_MULTIPLE = 16  # in_features the kernel takes


def available() -> bool:
    """True where the kernel is built and the CPU has AVX512-VNNI (and BW)."""
    fn = _lib.get("tm_int8_gemm_available")
    return fn is not None and bool(fn())


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) float -> codes (N, K) int8 in -127..127, scales (N,) fp32."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # (N,)
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def quantize_activations(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernel does to its input, in torch: x (M, K) -> u (M, K) in 0..255 (int32),
    scale (M,) fp32, zero point (M,) int32, x ~ scale * (u - zero). The range holds 0."""
    x = x2d.float()
    lo = x.amin(dim=1).clamp(max=0.0)
    hi = x.amax(dim=1).clamp(min=0.0)
    # fp32 throughout, rounding as the kernel does: products by reciprocals
    scale = torch.where(hi > lo, (hi - lo) * torch.tensor(1.0 / 255.0), torch.ones_like(hi))
    inv = 1.0 / scale
    zero = torch.round(-lo * inv).to(torch.int32)
    u = (torch.round(x * inv[:, None]).to(torch.int32) + zero[:, None]).clamp_(0, 255)
    return u, scale, zero


def reference(x2d: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernel's result computed in torch: (M, K) x codes (N, K) -> (M, N) bf16."""
    u, sx, zx = quantize_activations(x2d)
    acc = (u - zx[:, None]).double() @ codes.double().t()  # exact integer sums
    return (acc * scale.double()[None, :] * sx.double()[:, None]).to(torch.bfloat16)


class Int8DynamicWeight:
    """The large-batch weight of a quantized linear as w8a8 (the interface of
    dense.DenseWeight: `__call__(x2d)`, `nbytes`, `weight`)."""

    weight = None  # never the tied embedding's tensor: the codes are always a copy

    def __init__(self, weight: torch.Tensor) -> None:
        if not available():
            raise RuntimeError("the int8 GEMM kernel needs a C compiler and an "
                               "AVX512-VNNI CPU")
        self.out_features, self.in_features = weight.shape
        if self.in_features % K_MULTIPLE:
            raise ValueError(f"in_features {self.in_features} is not a multiple of "
                             f"{K_MULTIPLE}")
        codes, scale = quantize_weight(weight)
        n_pad = -(-self.out_features // 16) * 16
        self.packed = torch.empty(n_pad * self.in_features, dtype=torch.int8)
        self.wsum = torch.empty(n_pad, dtype=torch.int32)
        _lib.get("tm_int8_pack_weight")(codes.contiguous().data_ptr(), self.out_features,
                                         self.in_features, self.packed.data_ptr(),
                                         self.wsum.data_ptr())
        self.scale = torch.zeros(n_pad, dtype=torch.float32)
        self.scale[:self.out_features] = scale

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.wsum.numel() * 4 + self.scale.numel() * 4

    def __call__(self, x2d: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
                 ) -> torch.Tensor:
        """x2d: (M, K) bf16, contiguous -> (M, N) bf16 (the kernel rounds its output to
        bf16; another out_dtype gets those values widened)."""
        m = x2d.shape[0]
        x2d = x2d.to(torch.bfloat16).contiguous()
        y = torch.empty(m, self.out_features, dtype=torch.bfloat16)
        xu = torch.empty(m * self.in_features, dtype=torch.uint8)
        sx = torch.empty(m, dtype=torch.float32)
        zx = torch.empty(m, dtype=torch.int32)
        rc = _lib.get("tm_int8_gemm_bf16")(
            x2d.data_ptr(), m, self.in_features, self.packed.data_ptr(), self.wsum.data_ptr(),
            self.scale.data_ptr(), self.out_features, y.data_ptr(), xu.data_ptr(),
            sx.data_ptr(), zx.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"int8 GEMM failed on x {tuple(x2d.shape)}")
        return y.to(out_dtype)
