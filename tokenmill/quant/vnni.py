"""Int4 codes repacked for the int8-activation kernel (tokenmill/kernels/q4q8_gemv.c).

An `Int4Linear` built with `activations="int8"` holds its weight in this layout
instead of torch's int4 pack. Two forms, both read from the codes the torch kernel
takes (codes.py), so every GGUF type and `int4` map without a float detour:

    Q4: w = d * q + m, q in 0..15 (Q4_0, Q4_1, int4): d = scale, m = zero - 8 * scale
    Q8: w = d * q, q int8 (Q8_0, whose codes are [hi | lo] with q + 128 = 16 hi + lo)

d and m are stored as fp16 (GGUF's own precision: exact for GGUF blocks; `int4`
scales round to fp16, a relative 2^-11). Rows are padded to groups of 16 with
zero weights; the kernel writes only the real rows.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.kernels import q4q8_gemv
from tokenmill.quant.codes import GROUP_SIZE

ROWS = q4q8_gemv.ROWS


def available() -> bool:
    return q4q8_gemv.available()


def fast() -> bool:
    """The kernel is built with SIMD integer dot products (AVX512-VNNI or AVX2): worth
    being the default path."""
    return q4q8_gemv.isa() in ("avx512-vnni", "avx2")


def repack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, input_repeats: int
           ) -> tuple[torch.Tensor, int] | None:
    """Int4Linear's codes (N, K * r), scale and zero (N, K * r / 32) -> (uint8 records,
    format), or None where the weight has no exact form here (Q4 shards fused with Q8_0
    ones) or the kernel is not built."""
    if not q4q8_gemv.available():
        return None
    n = codes.shape[0]
    pad = -n % ROWS
    if input_repeats == 1:
        return _repack_q4(_pad(codes, pad), _pad(scale, pad), _pad(zero - 8 * scale, pad)), \
            q4q8_gemv.FORMAT_Q4
    if input_repeats != 2:
        return None
    nb = scale.shape[1] // 2
    d = scale[:, nb:]
    if not (torch.equal(zero[:, :nb], torch.zeros_like(d)) and torch.equal(scale[:, :nb], 16 * d)
            and torch.equal(zero[:, nb:], 8 * d)):
        return None
    hi_lo = codes.reshape(n, 2, nb, GROUP_SIZE)
    u = (hi_lo[:, 0] * 16 + hi_lo[:, 1]).to(torch.uint8)  # q + 128: (N, nb, 32)
    return _repack_q8(_pad(u, pad), _pad(d, pad)), q4q8_gemv.FORMAT_Q8


def repack_gguf(blocks: torch.Tensor, qtype: int, shape: tuple[int, ...]
                ) -> tuple[torch.Tensor, int] | None:
    """GGUF Q4_0 / Q4_1 / Q8_0 rows (blocks uint8 (N, bytes_per_row), shape (N, K)) ->
    the records `repack` makes from their codes, straight from the bytes: a record's
    quants are a permutation of the blocks' bytes and its d (and m) their fp16 scales,
    so loading skips the int32 codes. None for other types or where the kernel is not
    built."""
    from gguf import GGMLQuantizationType as QType

    if not q4q8_gemv.available() or qtype not in (QType.Q4_0, QType.Q4_1, QType.Q8_0):
        return None
    n, k = int(shape[0]), int(shape[1])
    nb = k // GROUP_SIZE
    b = blocks.numpy().reshape(n, nb, -1)
    pad = -n % ROWS
    if pad:  # zero bytes: scales 0, so weight 0
        b = np.concatenate([b, np.zeros((pad, nb, b.shape[2]), dtype=np.uint8)])
    g = (n + pad) // ROWS
    d = b[..., 0:2]

    def rows_last(a: np.ndarray) -> np.ndarray:  # (N, nb, 4 c) -> (G, nb, c * 16 * 4)
        width = a.shape[2]
        return (a.reshape(g, ROWS, nb, width // 4, 4).transpose(0, 2, 3, 1, 4)
                .reshape(g, nb, width * ROWS))

    def fp16_rows(a: np.ndarray) -> np.ndarray:  # (N, nb, 2) -> (G, nb, 32)
        return a.reshape(g, ROWS, nb, 2).transpose(0, 2, 1, 3).reshape(g, nb, 2 * ROWS)

    if qtype == QType.Q8_0:
        u = b[..., 2:] ^ np.uint8(0x80)  # q + 128
        u[n:] = 0  # padded rows as `repack` pads them (weight 0 either way: d = 0)
        parts, fmt = [rows_last(u), fp16_rows(d)], q4q8_gemv.FORMAT_Q8
    else:
        if qtype == QType.Q4_1:
            m = b[..., 2:4]
        else:  # Q4_0: w = d (q - 8) -> m = 0 - 8 d (exact in fp16 unless it overflows)
            m = (np.float16(0) - 8 * np.ascontiguousarray(d).view(np.float16)).view(np.uint8)
        parts, fmt = [rows_last(b[..., -16:]), fp16_rows(d), fp16_rows(m)], q4q8_gemv.FORMAT_Q4
    return torch.from_numpy(np.concatenate(parts, axis=2).reshape(-1)), fmt


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((rows, *t.shape[1:]))]) if rows else t


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """(N, nb) -> (G, nb, 32) bytes: the fp16 values of 16 rows per record."""
    n, nb = v.shape
    b = v.to(torch.float16).contiguous().view(torch.uint8).reshape(n // ROWS, ROWS, nb, 2)
    return b.permute(0, 2, 1, 3).reshape(n // ROWS, nb, 2 * ROWS)


def _interleave(qs: torch.Tensor) -> torch.Tensor:
    """(N, nb, 4 * chunks) bytes -> (G, nb, chunks * 16 * 4): chunk, row, 4 bytes."""
    n, nb, width = qs.shape
    chunks = width // 4
    return (qs.reshape(n // ROWS, ROWS, nb, chunks, 4).permute(0, 2, 3, 1, 4)
            .reshape(n // ROWS, nb, width * ROWS))


def _repack_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    nb = k // GROUP_SIZE
    halves = codes.reshape(n, nb, 2, GROUP_SIZE // 2).to(torch.uint8)
    qs = halves[:, :, 0] | (halves[:, :, 1] << 4)  # GGUF's byte order: (N, nb, 16)
    return torch.cat([_interleave(qs), _fp16_bytes(d), _fp16_bytes(m)], dim=2).reshape(-1)


def _repack_q8(u: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return torch.cat([_interleave(u), _fp16_bytes(d)], dim=2).reshape(-1)
