"""GGUF blocks of every common type -> the quantized-activation kernel's records
(q4q8_gemv.c: Q4 records w = d q + m, q in 0..15; Q8 records w = d q, q int8; d, m
fp16 per row and block of 32), so that a K-quant file runs on the same per-row, batched
(gemm16) and fused-decode-step kernels as Q4_0 / Q4_1 / Q8_0, each tensor in its own
form. One form per type (FORMS), chosen to keep the file's bytes and numerics:

    Q4_0, Q4_1, Q8_0   exact (vnni.repack_gguf)
    Q5_0               Q8 records of q - 16: exact, 34 bytes a block of 32 for 22
    Q4_K               Q4 records per sub-block of 32: d = d_super * sc, m = -dmin * min,
                       rounded to fp16 (a relative 2^-11 on a 4-bit weight's scale):
                       20 bytes a block for 18
    Q5_1, Q5_K, Q6_K,  Q8 records requantized from the dequantized weight, per block of
    IQ4_NL, IQ4_XS     32 (|error| <= the block's max / 254, Q8_0's own rounding, about a
                       sixteenth of Q6_K's): 34 bytes a block for 24-26

A fused linear whose shards take different forms (a Q4_K gate beside a Q6_K up) takes
the Q8 form for all of them (its Q4-form shards requantized). Types not listed (IQ2_XXS,
Q2_K, ...) have no record form: their linears stay float (the caller says so by name).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from tokenmill.kernels import q4q8_gemv
from tokenmill.quant import vnni
from tokenmill.quant.gguf_dequant import dequantize as dequantize_blocks

QK = 32
EXACT_TYPES = (QType.Q4_0, QType.Q4_1, QType.Q8_0)  # vnni.repack_gguf's
FORMS = {
    QType.Q4_0: "q4 exact", QType.Q4_1: "q4 exact", QType.Q8_0: "q8 exact",
    QType.Q5_0: "q8 exact", QType.Q4_K: "q4, fp16 sub-block scales",
    QType.Q5_1: "q8 requantized", QType.Q5_K: "q8 requantized",
    QType.Q6_K: "q8 requantized", QType.IQ4_NL: "q8 requantized",
    QType.IQ4_XS: "q8 requantized",
}
RECORD_TYPES = frozenset(FORMS)  # the types this module turns into records
_ROWS_AT_ONCE = 4096  # rows dequantized at a time when requantizing (bounds the fp32 copy)


def repack_shards(shards: Sequence[Any]) -> tuple[torch.Tensor, int, str] | None:
    """The loader's `QuantizedWeight`s of one (possibly fused) linear, in row order ->
    (records, format, form), or None where a shard's type has no form here or the kernel
    is not built. `form` says how the records stand for the file's blocks (FORMS)."""
    if not q4q8_gemv.available() or any(QType(s.qtype) not in RECORD_TYPES for s in shards):
        return None
    for s in shards:  # the kernels trust these sizes: check them once more here
        block, block_bytes = GGML_QUANT_SIZES[QType(s.qtype)]
        if s.shape[1] % block or s.blocks.numel() != s.shape[0] * s.shape[1] // block * block_bytes:
            raise ValueError(f"{QType(s.qtype).name} blocks of {s.blocks.numel()} bytes do not "
                             f"hold a ({s.shape[0]}, {s.shape[1]}) weight")
    types = {QType(s.qtype) for s in shards}
    if len(types) == 1 and next(iter(types)) in EXACT_TYPES:
        rows = sum(s.shape[0] for s in shards)
        blocks = torch.cat([s.blocks for s in shards]) if len(shards) > 1 else shards[0].blocks
        packed = vnni.repack_gguf(blocks, next(iter(types)), (rows, shards[0].shape[1]))
        return None if packed is None else (*packed, FORMS[next(iter(types))])
    parts = [_parts(QType(s.qtype), s.blocks.numpy(), s.shape) for s in shards]
    if len({p[0] for p in parts}) > 1:  # Q4 and Q8 forms fused: Q8 for all
        parts = [p if p[0] == "q8" else _q8_from_q4(*p[1:]) for p in parts]
    kind = parts[0][0]
    pad = -sum(p[1].shape[0] for p in parts) % q4q8_gemv.ROWS
    cat = [torch.from_numpy(np.concatenate([p[i] for p in parts])) for i in range(1, len(parts[0]))]
    forms = sorted({FORMS[t] for t in types} | ({"q8 requantized"} if kind == "q8" and any(
        FORMS[t].startswith("q4") for t in types) else set()))
    form = ", ".join(forms)
    if kind == "q4":
        qs, d, m = (vnni._pad(t, pad) for t in cat)
        return vnni._q4_records(qs, d.half(), m.half()), q4q8_gemv.FORMAT_Q4, form
    u, d = (vnni._pad(t, pad) for t in cat)
    return vnni._repack_q8(u, d.half()), q4q8_gemv.FORMAT_Q8, form


def _parts(qtype: QType, blocks: np.ndarray, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """One shard's record parts: ("q4", qs (N, nb, 16) uint8 in GGUF Q4 byte order, d, m
    (N, nb) fp32 holding fp16 values) or ("q8", u (N, nb, 32) uint8 = q + 128, d)."""
    n, k = int(shape[0]), int(shape[1])
    nb = k // QK
    rows = blocks.reshape(n, -1)
    if qtype in EXACT_TYPES or qtype == QType.Q5_0:
        b = rows.reshape(n, nb, -1)
        d = _f16(b[..., 0:2])
        if qtype == QType.Q8_0:
            return "q8", b[..., 2:] ^ np.uint8(0x80), d
        if qtype == QType.Q5_0:  # d (q - 16), q = 16 * bit of qh + nibble of qs
            qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)  # (n, nb, 1)
            bits = ((qh >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)
            q = np.concatenate([b[..., 6:] & 15, b[..., 6:] >> 4], axis=-1) | (bits << 4)
            return "q8", q + np.uint8(112), d  # q - 16 + 128
        m = _f16(b[..., 2:4]) if qtype == QType.Q4_1 else -8 * d
        return "q4", np.ascontiguousarray(b[..., -16:]), d, m
    if qtype == QType.Q4_K:
        parts = _q4_k(rows.reshape(n * (k // 256), 144), n, nb)
        if parts is not None:
            return parts
    return _requantized(qtype, rows, n, k)


def _q4_k(b: np.ndarray, n: int, nb: int) -> tuple[Any, ...] | None:
    """Q4_K super-blocks (n * nb / 8, 144) -> Q4 parts; None if a product overflows fp16."""
    from gguf.quants import Q4_K

    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (S,)
    sc, mn = Q4_K.get_scale_min(b[:, 4:16])  # (S, 8) each
    d_sub = (d[:, None] * torch.from_numpy(sc.astype(np.float32))).half()
    m_sub = (-dmin[:, None] * torch.from_numpy(mn.astype(np.float32))).half()
    if not (torch.isfinite(d_sub).all() and torch.isfinite(m_sub).all()):
        return None
    # qs: 4 chunks of 32 bytes; chunk j's low nibbles are sub-block 2j, high ones 2j + 1
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(15)).reshape(-1, 8, 32)  # (S, 8 sub-blocks, 32 values)
    packed = q[..., :16] | (q[..., 16:] << np.uint8(4))  # Q4 byte order: q[i], q[i + 16]
    return ("q4", packed.reshape(n, nb, 16), d_sub.float().reshape(n, nb),
            m_sub.float().reshape(n, nb))


def _requantized(qtype: QType, rows: np.ndarray, n: int, k: int) -> tuple[Any, ...]:
    """Q8 parts of the dequantized weight, per block of 32: d = fp16(max|w| / 127)."""
    u = np.empty((n, k // QK, QK), np.uint8)
    d = torch.empty((n, k // QK))
    for r0 in range(0, n, _ROWS_AT_ONCE):
        w = dequantize_blocks(rows[r0:r0 + _ROWS_AT_ONCE], qtype).reshape(-1, k // QK, QK)
        u[r0:r0 + len(w)], d[r0:r0 + len(w)] = _q8(torch.from_numpy(np.asarray(w, np.float32)))
    return "q8", u, d


def _q8(w: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """w (N, nb, 32) fp32 -> (u = q + 128 uint8, d fp32 holding fp16 values)."""
    d = (w.abs().amax(-1) / 127).half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = (w * inv[..., None]).round().clamp(-127, 127).to(torch.int16) + 128
    return q.to(torch.uint8).numpy(), d


def _q8_from_q4(qs: np.ndarray, d: torch.Tensor, m: torch.Tensor) -> tuple[Any, ...]:
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)  # (N, nb, 32)
    w = torch.from_numpy(q) * d[..., None] + m[..., None]
    return ("q8", *_q8(w))


def _f16(two_bytes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(
        np.float32))
