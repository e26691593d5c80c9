"""Integer codes for the CPU weight-only kernels, from GGUF blocks or float weights,
and the float weights they stand for (the references the tests compare with).

int4 (`aten._weight_int4pack_mm_for_cpu`) computes w = (q - 8) * scale + zero,
q in 0..15, one (scale, zero) per group of 32 inputs (checked against torch
2.13's kernel source and empirically). GGUF blocks map onto it with integer
unpacking only, never through float weights:

    Q4_0  d * (q - 8)   -> scale d, zero 0
    Q4_1  d * q + m     -> scale d, zero m + 8d
    Q8_0  d * q, q int8: with u = q + 128 = 16 hi + lo (hi, lo in 0..15),
          d * q = 16d (hi - 8) + [d (lo - 8) + 8d]
          -> one int4 matmul of [x | x] against codes [hi | lo] (K doubled):
          exact, 1 byte per weight plus scales. The int8 kernel takes only one
          scale per output row, and re-quantizing Q8_0 to that is lossy.

int8 (`aten._weight_int8pack_mm`): w = q * scale, one scale per output row.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

GROUP_SIZE = 32  # GGUF's block size, and our int4 group size
# GGUF types that map onto the int4 kernel -> block size in bytes
GGUF_NATIVE_TYPES = {QType.Q4_0: 18, QType.Q4_1: 20, QType.Q8_0: 34}


def int4_codes_from_gguf(blocks: torch.Tensor, qtype: QType, shape: tuple[int, ...]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """GGUF Q4_0 / Q4_1 / Q8_0 rows -> (codes, scale, zero, input_repeats).

    blocks: uint8 (N, bytes_per_row); shape: (N, K) of the dequantized weight.
    codes: int32 (N, K * r) in 0..15, as the pack op takes them; scale, zero: float32
    (N, K * r / 32); r is 1 for Q4_*, 2 for Q8_0 (see the module docstring)."""
    out_features, in_features = int(shape[0]), int(shape[1])
    block_bytes = GGUF_NATIVE_TYPES.get(QType(qtype))
    if block_bytes is None:
        raise ValueError(f"GGUF type {QType(qtype).name} has no native int4 path")
    num_blocks = in_features // GROUP_SIZE
    # numpy: its strided uint8 -> int32 bit ops run ~2x faster than torch's here
    b = blocks.numpy().reshape(out_features, num_blocks, block_bytes)  # (N, nb, bytes)
    d = _f16(b[..., 0:2])  # (N, nb)
    if qtype == QType.Q8_0:
        u = b[..., 2:] ^ np.uint8(0x80)  # int8 q as uint8 q + 128: (N, nb, 32)
        codes = np.empty((out_features, 2, num_blocks, GROUP_SIZE), dtype=np.int32)
        np.right_shift(u, 4, out=codes[:, 0], casting="unsafe")  # hi part
        np.bitwise_and(u, 15, out=codes[:, 1], casting="unsafe")  # lo part
        scale = torch.cat([16 * d, d], dim=1)
        zero = torch.cat([torch.zeros_like(d), 8 * d], dim=1)
        return torch.from_numpy(codes).reshape(out_features, -1), scale, zero, 2
    qs = b[..., -16:]  # byte j holds q[j] in its low nibble and q[j + 16] in its high one
    codes = np.empty((out_features, num_blocks, 2, GROUP_SIZE // 2), dtype=np.int32)
    np.bitwise_and(qs, 15, out=codes[:, :, 0], casting="unsafe")
    np.right_shift(qs, 4, out=codes[:, :, 1], casting="unsafe")
    codes_t = torch.from_numpy(codes).reshape(out_features, in_features)
    if qtype == QType.Q4_0:
        return codes_t, d, torch.zeros_like(d), 1
    return codes_t, d, _f16(b[..., 2:4]) + 8 * d, 1


def _f16(two_bytes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(two_bytes).view(np.float16)[..., 0]).float()


def int4_codes_from_float(weight: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-32 asymmetric min/max quantization (as GGUF Q4_1 does).
    weight (N, K) -> codes int32 (N, K), scale and zero float32 (N, K / 32)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = (hi - lo) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = ((groups - lo[..., None]) * inv[..., None]).round().clamp(0, 15)
    return codes.to(torch.int32).reshape(n, k), scale, lo + 8 * scale


def int8_codes_from_float(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric: weight (N, K) -> codes int8 (N, K), scale float32 (N,)."""
    w = weight.float()
    scale = w.abs().amax(-1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (w * inv[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    input_repeats: int = 1) -> torch.Tensor:
    """The float32 weight (N, K) that int4 codes stand for."""
    n = codes.shape[0]
    w = (codes.float() - 8).reshape(n, -1, GROUP_SIZE) * scale[..., None] + zero[..., None]
    return w.reshape(n, input_repeats, -1).sum(1)  # the Q8_0 form is [hi part | lo part]


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.reshape(-1, 1)
