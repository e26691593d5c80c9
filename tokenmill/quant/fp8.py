"""fp8 (e4m3) weights for GPUs that have fp8 tensor cores (sm_89+: Ada, Hopper).

Per-output-channel weight scales, fixed at load; per-token activation scales,
computed each call (one triton kernel, triton_layer_ops.quantize_rows_fp8); the
matmul is `torch._scaled_mm`, which multiplies the two e4m3 operands on tensor
cores and applies both scales in its epilogue, or for decode batches of up to 64
rows triton_fp8_gemm's kernel, which computes the same product at the rate the
weights stream (cuBLASLt's 128 x 128 tiles do not, at a few rows); up to 16 rows
its fused form quantizes the activations and sums the K splits in the same launch. Halving
the bytes a decode step reads is the first lever `explain` names on an
H100/H200. On a CPU the same quantized numbers run through a dequantized
matmul (what `_scaled_mm` computes, up to its accumulation order): tests only,
since `--quantization fp8` refuses devices without fp8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import layer_ops

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# _scaled_mm wants both dimensions of both operands to be multiples of 16: the
# activations' rows are padded, and quantize_model keeps a weight of another width float
FP8_DIM_MULTIPLE = 16


def fp8_unavailable_reason(device: torch.device) -> str | None:
    """None when `device` runs fp8 matmuls; else why not (one line)."""
    if device.type != "cuda":
        return (f"fp8 weights need a CUDA GPU with fp8 tensor cores (compute capability "
                f"8.9+, torch._scaled_mm); this is {device.type}")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return (f"fp8 weights need compute capability 8.9+ (Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}")
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) -> e4m3 codes (R, C) and one float32 scale per row (R, 1), so that
    codes * scale ~ x: each row's largest magnitude maps to 448."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp_(min=1e-12)  # an all-zero row keeps scale > 0
    codes = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W as e4m3 per output channel and x as e4m3 per token."""

    # decode batches (up to 64 rows) on triton_fp8_gemm's kernel; off: _scaled_mm for
    # every batch (gpu_check.py's A/B)
    small_batch_kernel = True
    # up to 16 rows, that kernel's fused form: the activation scales and the split sums
    # in the one launch (triton_fp8_gemm.fp8_linear); off: three kernels (gpu_check's A/B)
    fused_small_batch = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scale = quantize_rows(weight.detach())  # (N, K), (N, 1)
        self.register_buffer("weight_fp8", codes)
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())  # (1, N)
        self.bias = None if bias is None else bias.detach()
        self.out_dtype = weight.dtype

    def lowbit_bytes(self) -> int:
        return self.weight_fp8.numel() + self.weight_scale.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)  # (M, K)
        if x.device.type == "cuda":
            y = self._scaled_mm(x2d)
        else:
            codes, x_scale = quantize_rows(x2d)  # (M, K) e4m3, (M, 1)
            y = (dequantize_rows(codes, x_scale) @ dequantize_rows(
                self.weight_fp8, self.weight_scale.reshape(-1, 1)).t()).to(self.out_dtype)
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _scaled_mm(self, x2d: torch.Tensor) -> torch.Tensor:
        m = x2d.shape[0]
        ops = layer_ops.triton_ops()
        if (ops is not None and self.small_batch_kernel and self.fused_small_batch
                and x2d.dtype == self.out_dtype):
            from tokenmill.kernels import triton_fp8_gemm

            y = triton_fp8_gemm.fp8_linear(x2d, self.weight_fp8, self.weight_scale, self.bias,
                                           layer_ops.num_sms(x2d.device))
            if y is not None:  # up to 16 rows: one kernel
                return y
        done = None if ops is None else ops.quantize_rows_fp8(x2d, FP8_DIM_MULTIPLE)
        if done is not None:  # one kernel: the codes, the scales and the padding rows
            codes, x_scale = done
            if self.small_batch_kernel:  # triton imported above: its fp8 GEMM imports too
                from tokenmill.kernels import triton_fp8_gemm

                y = triton_fp8_gemm.fp8_gemm(codes, x_scale, self.weight_fp8, self.weight_scale,
                                             self.bias, self.out_dtype, m, layer_ops.num_sms(x2d.device))
                if y is not None:  # a decode batch (up to 64 rows)
                    return y
        else:
            codes, x_scale = quantize_rows(x2d)  # (M, K) e4m3, (M, 1)
            pad = -m % FP8_DIM_MULTIPLE
            if pad:
                codes = F.pad(codes.view(torch.uint8), (0, 0, 0, pad)).view(FP8)
                x_scale = F.pad(x_scale, (0, 0, 0, pad), value=1.0)
        # weight_fp8.t() is (K, N) column-major, the layout _scaled_mm's second operand needs
        y = torch._scaled_mm(codes, self.weight_fp8.t(), scale_a=x_scale,
                             scale_b=self.weight_scale, bias=self.bias,
                             out_dtype=self.out_dtype)
        return y[:m]
