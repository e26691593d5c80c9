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
    b = blocks.reshape(n, k // GROUP_SIZE, -1)  # (N, nb, bytes per block)
    pad = -n % ROWS  # padded rows: zero bytes and zero scales, so weight 0

    def fp16(two_bytes: torch.Tensor) -> torch.Tensor:  # (N, nb, 2) bytes -> (N, nb)
        return two_bytes.contiguous().view(torch.float16)[..., 0]

    d = fp16(b[..., 0:2])
    if qtype == QType.Q8_0:
        return _repack_q8(_pad(b[..., 2:] ^ 0x80, pad), _pad(d, pad)), q4q8_gemv.FORMAT_Q8
    # Q4_0: w = d (q - 8), so m = 0 - 8 d (exact in fp16 unless it overflows)
    m = fp16(b[..., 2:4]) if qtype == QType.Q4_1 else torch.zeros_like(d) - 8 * d
    return _q4_records(_pad(b[..., -16:], pad), _pad(d, pad), _pad(m, pad)), \
        q4q8_gemv.FORMAT_Q4


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((rows, *t.shape[1:]))]) if rows else t


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """(N, nb) -> (G, nb, 32) bytes: the fp16 values of 16 rows per record (moved as
    int16 elements, not bytes: torch copies a permuted byte tensor several times slower)."""
    n, nb = v.shape
    h = v.to(torch.float16).contiguous().view(torch.int16).reshape(n // ROWS, ROWS, nb)
    return h.permute(0, 2, 1).contiguous().view(torch.uint8).reshape(n // ROWS, nb, 2 * ROWS)


def _interleave(qs: torch.Tensor) -> torch.Tensor:
    """(N, nb, 4 * chunks) bytes -> (G, nb, chunks * 16 * 4): chunk, row, 4 bytes (each
    4-byte group moved as one int32)."""
    n, nb, width = qs.shape
    chunks = width // 4
    words = qs.contiguous().view(torch.int32)  # (N, nb, chunks)
    return (words.reshape(n // ROWS, ROWS, nb, chunks).permute(0, 2, 3, 1).contiguous()
            .view(torch.uint8).reshape(n // ROWS, nb, width * ROWS))


def _repack_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    nb = k // GROUP_SIZE
    halves = codes.reshape(n, nb, 2, GROUP_SIZE // 2).to(torch.uint8)
    qs = halves[:, :, 0] | (halves[:, :, 1] << 4)  # GGUF's byte order: (N, nb, 16)
    return _q4_records(qs, d, m)


def _q4_records(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(N, nb, 16) quant bytes in GGUF's order, d and m (N, nb) -> Q4 records."""
    return torch.cat([_interleave(qs), _fp16_bytes(d), _fp16_bytes(m)], dim=2).reshape(-1)


def _repack_q8(u: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return torch.cat([_interleave(u), _fp16_bytes(d)], dim=2).reshape(-1)
