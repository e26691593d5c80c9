"""GGUF blocks of every common type -> the quantized-activation kernel's records
(q4q8_gemv.c: Q4 records w = d q + m, q in 0..15, optionally with a plane of 1 or 2
high bits a weight, q in 0..31 (Q5) or 0..63 (Q6); Q8 records w = d q, q int8; d, m
fp16 per row and block of 32), so that a K-quant file runs on the same per-row, batched
(gemm16) and fused-decode-step kernels as Q4_0 / Q4_1 / Q8_0, each tensor in its own
form. One form per type (FORMS), chosen to keep the file's bytes and numerics (record
bytes a block of 32 against the type's own):

    Q4_0, Q4_1, Q8_0   exact (vnni.repack_gguf)
    Q5_0, Q5_1         Q5 records, exact (Q5_0: m = -16 d): 24 bytes for 22 / 24
    Q4_K               Q4K records: the file's own super-blocks of 256 (fp16 d, dmin,
                       6-bit sub-block scales and mins, repacked per group of 16 rows),
                       exact: 18 bytes for 18 (q4q8_gemv.c's FMT_Q4K)
    Q5_K               Q5 records, its sub-block scales and mins rounded to fp16 as Q4_K's:
                       24 bytes for 22
    Q6_K               Q8 records requantized per block of 32 (Q6_K has a scale per 16,
                       the records one per 32): |error| <= the block's max / 254; 34
                       bytes for 26.25. Q6_SMALL_FORM picks the 6-bit form instead (28
                       bytes): per block the better of (a) the larger-|scale| half's
                       scale, d = fp16(d_super * sc), m = -32 d: that half exact, the
                       other rounded to it (|error| <= half its step, and exact where
                       both scales are equal) and (b) min/max, d = (max - min) / 63:
                       |error| <= (max - min) / 126; plus fp16 rounding of d and m. The
                       6-bit form's error is 4x the 8-bit one's and measurable: on
                       SmolLM2's Q6_K file (its ffn_down) the KLD gate's decode-rows
                       mean KLD, 4 chunks, read gguf-a16 0.00232 -> 0.00077 and gguf-a8
                       0.00465 -> 0.00315 (llama.cpp 0.00410) going from 6-bit to 8-bit
                       records (docs/accuracy_gate.md)
    IQ4_NL, IQ4_XS     Q8 records requantized from the dequantized weight, per block of
                       32 (|error| <= the block's max / 254): 34 bytes for 18 / 17

A fused linear whose shards take different forms (a Q4_K q and k beside a Q6_K v) keeps
each in its own (q4q8_gemv.c's FMT_MIXED: a header naming each part's groups and
format), where every shard but the last fills whole groups of 16 rows; otherwise it
takes the Q8 form for all of them (requantized). Types not listed (IQ2_XXS, Q2_K, ...)
have no record form: their linears stay float (the caller says so by name).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
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
    QType.Q5_0: "q5 exact", QType.Q5_1: "q5 exact", QType.Q4_K: "q4k exact",
    QType.Q5_K: "q5, fp16 sub-block scales", QType.Q6_K: "q8 requantized",
    QType.IQ4_NL: "q8 requantized", QType.IQ4_XS: "q8 requantized",
}
# Q6_K as 6-bit records (28 bytes a block of 32, "q6 requantized per 32") instead of
# 8-bit ones (34). The 8-bit form is closer to the file (the accuracy gate: see the
# module docstring) but holds 1.30x its Q6_K bytes, against issue 56's rule of resident
# weights within 1.15x the file where a float copy would pass 1 GiB: quant.model picks
# the 6-bit form for such models (`small_q6_form`). True here forces it everywhere
# (tests use it to keep that form's kernels, FMT_Q6, covered).
Q6_SMALL_FORM = False
Q6_SMALL_FORM_NAME = "q6 requantized per 32"
RECORD_TYPES = frozenset(FORMS)  # the types this module turns into records


def form_of(qtype: QType) -> str:
    """How a type's records stand for its blocks (FORMS, Q6_SMALL_FORM applied)."""
    return Q6_SMALL_FORM_NAME if qtype == QType.Q6_K and Q6_SMALL_FORM else FORMS[qtype]


@contextlib.contextmanager
def small_q6_form(small: bool) -> Iterator[None]:
    """Q6_K's 6-bit form while the block runs if `small` (or Q6_SMALL_FORM already)."""
    global Q6_SMALL_FORM
    saved = Q6_SMALL_FORM
    Q6_SMALL_FORM = saved or small
    try:
        yield
    finally:
        Q6_SMALL_FORM = saved

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
    forms = {form_of(t) for t in types}
    if len({p[0] for p in parts}) > 1 and not all(s.shape[0] % q4q8_gemv.ROWS == 0
                                                  for s in shards[:-1]):
        # forms fused whose parts end inside a group of 16 rows: Q8 for all
        parts = [p if p[0] == "q8" else _q8_from_q4x(p) for p in parts]
        forms |= {"q8 requantized"}
    if len({p[0] for p in parts}) == 1:
        joined = (parts[0][0], *(np.concatenate([np.asarray(p[i]) for p in parts])
                                 for i in range(1, len(parts[0]))))
        records, fmt = _records(joined, -sum(s.shape[0] for s in shards) % q4q8_gemv.ROWS)
    else:  # each part in its own form (q4q8_gemv.c's FMT_MIXED)
        records, fmt = q4q8_gemv.mixed(
            [_records(p, 0 if i < len(parts) - 1 else -s.shape[0] % q4q8_gemv.ROWS)
             for i, (p, s) in enumerate(zip(parts, shards, strict=True))], shards[0].shape[1])
    return records, fmt, ", ".join(sorted(forms))


_HIGH_BITS = {"q5": 1, "q6": 2}


def _records(parts: tuple[Any, ...], pad: int) -> tuple[torch.Tensor, int]:
    """One weight's parts (_parts) -> its records and format, `pad` zero rows added."""
    t = [vnni._pad(torch.as_tensor(np.ascontiguousarray(p)), pad) for p in parts[1:]]
    if parts[0] == "q4":
        return vnni._q4_records(t[0], t[1].half(), t[2].half()), q4q8_gemv.FORMAT_Q4
    if parts[0] == "q8":
        return vnni._repack_q8(t[0], t[1].half()), q4q8_gemv.FORMAT_Q8
    if parts[0] == "q4k":
        return _q4k_records(*t), q4q8_gemv.FORMAT_Q4K
    hb = _HIGH_BITS[parts[0]]
    q = t[0]  # (N, nb, 32) values 0 .. 2^(4 + hb) - 1
    low = q & 15
    qs = low[..., :16] | (low[..., 16:] << 4)  # GGUF's Q4 byte order
    n, nb = q.shape[:2]
    # the high-bit plane (q4q8_gemv.c add_high512): chunk c, byte i = 4 r + j of its 64
    # holds e = high bits of q[4c + j] | those of q[16 + 4c + j] << hb, stored at bits
    # 2 hb t of plane byte i % (16 hb), t = i // (16 hb)
    high = q >> 4
    e = (high[..., :16] | (high[..., 16:] << hb)).reshape(n // q4q8_gemv.ROWS, q4q8_gemv.ROWS,
                                                           nb, 4, 4)
    e = e.permute(0, 2, 3, 1, 4).reshape(n // q4q8_gemv.ROWS, nb, 4, 4 // hb, 16 * hb)
    shifts = (2 * hb * torch.arange(4 // hb, dtype=torch.uint8)).reshape(1, 1, 1, -1, 1)
    plane = (e << shifts).sum(3, dtype=torch.uint8).reshape(n // q4q8_gemv.ROWS, nb, 64 * hb)
    head = vnni._q4_records(qs, t[1].half(), t[2].half()).reshape(n // q4q8_gemv.ROWS, nb, -1)
    fmt = q4q8_gemv.FORMAT_Q5 if hb == 1 else q4q8_gemv.FORMAT_Q6
    return torch.cat([head, plane], dim=2).reshape(-1), fmt


def _q4k_records(qs: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
                 mn: torch.Tensor) -> torch.Tensor:
    """Q4_K parts (_q4_k; rows a multiple of 16) -> FMT_Q4K records (q4q8_gemv.c): per
    group of 16 rows and super-block, its 8 sub-blocks' nibbles as Q4 records' (256
    bytes each), then d[16], dmin[16] fp16, lows[8][16] and highs[4][16]."""
    n, nb = qs.shape[:2]
    g, s = n // q4q8_gemv.ROWS, nb // 8
    nibbles = vnni._interleave(qs).reshape(g, s, 8 * 256)

    def by_row(t: torch.Tensor) -> torch.Tensor:  # (n, S, c) -> (G, S, c * 16)
        return t.reshape(g, q4q8_gemv.ROWS, s, -1).permute(0, 2, 3, 1).reshape(g, s, -1)

    lows = (sc & 15) | ((mn & 15) << 4)  # (n, S, 8)
    high = (sc >> 4) | ((mn >> 4) << 2)  # 4 bits a sub-block
    highs = high[..., :4] | (high[..., 4:] << 4)  # (n, S, 4)
    meta = [vnni._fp16_bytes(d), vnni._fp16_bytes(dmin), by_row(lows), by_row(highs)]
    return torch.cat([nibbles, *meta], dim=2).reshape(-1)


def _parts(qtype: QType, blocks: np.ndarray, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """One shard's record parts: ("q4", qs (N, nb, 16) uint8 in GGUF Q4 byte order, d, m
    (N, nb) fp32 holding fp16 values), ("q5" / "q6", q (N, nb, 32) uint8 values, d, m)
    or ("q8", u (N, nb, 32) uint8 = q + 128, d)."""
    n, k = int(shape[0]), int(shape[1])
    nb = k // QK
    rows = blocks.reshape(n, -1)
    if qtype in EXACT_TYPES or qtype in (QType.Q5_0, QType.Q5_1):
        b = rows.reshape(n, nb, -1)
        d = _f16(b[..., 0:2])
        if qtype == QType.Q8_0:
            return "q8", b[..., 2:] ^ np.uint8(0x80), d
        if qtype in (QType.Q5_0, QType.Q5_1):  # q = 16 * bit of qh + nibble of qs
            qh_at = 4 if qtype == QType.Q5_1 else 2
            qh = np.ascontiguousarray(b[..., qh_at:qh_at + 4]).view(np.uint32)  # (n, nb, 1)
            bits = ((qh >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.uint8)
            qs = b[..., qh_at + 4:]
            q = np.concatenate([qs & 15, qs >> 4], axis=-1) | (bits << 4)
            m = _f16(b[..., 2:4]) if qtype == QType.Q5_1 else (-16 * d).half().float()
            if torch.isfinite(m).all():
                return "q5", q, d, m
            return _requantized(qtype, rows, n, k)
        m = _f16(b[..., 2:4]) if qtype == QType.Q4_1 else -8 * d
        return "q4", np.ascontiguousarray(b[..., -16:]), d, m
    if qtype == QType.Q4_K:
        return _q4_k(rows.reshape(n * (k // 256), 144), n, nb)
    if qtype == QType.Q5_K:
        parts = _q5_k(rows.reshape(n * (k // 256), 176), n, nb)
        if parts is not None:
            return parts
    if qtype == QType.Q6_K and Q6_SMALL_FORM:
        parts = _q6_k(rows.reshape(n * (k // 256), 210), n, nb)
        if parts is not None:
            return parts
    return _requantized(qtype, rows, n, k)


def _k_scales(b: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Q4_K / Q5_K super-blocks (S, bytes) -> per sub-block d = d * sc, m = -dmin * min
    (S, 8) fp32 holding fp16 values; None if one overflows fp16."""
    from gguf.quants import Q4_K

    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (S,)
    sc, mn = Q4_K.get_scale_min(b[:, 4:16])  # (S, 8) each
    d_sub = (d[:, None] * torch.from_numpy(sc.astype(np.float32))).half()
    m_sub = (-dmin[:, None] * torch.from_numpy(mn.astype(np.float32))).half()
    if not (torch.isfinite(d_sub).all() and torch.isfinite(m_sub).all()):
        return None
    return d_sub.float(), m_sub.float()


def _q5_k(b: np.ndarray, n: int, nb: int) -> tuple[Any, ...] | None:
    """Q5_K super-blocks (n * nb / 8, 176) -> Q5 parts; None if a scale overflows fp16."""
    scales = _k_scales(b)
    if scales is None:
        return None
    ql = (b[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1))
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = (ql & np.uint8(15)).reshape(-1, 8, 32) | ((qh & np.uint8(1)) << np.uint8(4))
    return "q5", q.reshape(n, nb, 32), scales[0].reshape(n, nb), scales[1].reshape(n, nb)


def _q4_k(b: np.ndarray, n: int, nb: int) -> tuple[Any, ...]:
    """Q4_K super-blocks (n * nb / 8, 144) -> ("q4k", qs (n, nb, 16) in Q4 byte order, d,
    dmin (n, nb / 8) fp32 holding the file's fp16, sc, mn (n, nb / 8, 8) uint8 6-bit)."""
    from gguf.quants import Q4_K

    sc, mn = Q4_K.get_scale_min(b[:, 4:16])  # (S, 8) each
    # qs: 4 chunks of 32 bytes; chunk j's low nibbles are sub-block 2j, high ones 2j + 1
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(15)).reshape(-1, 8, 32)  # (S, 8 sub-blocks, 32 values)
    packed = q[..., :16] | (q[..., 16:] << np.uint8(4))  # Q4 byte order: q[i], q[i + 16]
    s = nb // 8
    return ("q4k", packed.reshape(n, nb, 16), _f16(b[:, 0:2]).reshape(n, s),
            _f16(b[:, 2:4]).reshape(n, s), np.asarray(sc, np.uint8).reshape(n, s, 8),
            np.asarray(mn, np.uint8).reshape(n, s, 8))


def _q6_k(b: np.ndarray, n: int, nb: int) -> tuple[Any, ...] | None:
    """Q6_K super-blocks (n * nb / 8, 210) -> Q6 parts requantized per block of 32 (see
    the module docstring), a bounded number of super-blocks at a time (the fp32
    temporaries of a 49,152 x 2,048 embedding would be GBs); None if a scale overflows
    fp16."""
    at_once = _ROWS_AT_ONCE * 16
    parts = [_q6_k_blocks(b[i:i + at_once]) for i in range(0, len(b), at_once)]
    if any(p is None for p in parts):
        return None
    q, d, m = (np.concatenate([np.asarray(p[i]) for p in parts]) for i in range(3))
    return "q6", q.reshape(n, nb, 32), torch.from_numpy(d).reshape(n, nb), \
        torch.from_numpy(m).reshape(n, nb)


def _q6_k_blocks(b: np.ndarray) -> tuple[np.ndarray, torch.Tensor, torch.Tensor] | None:
    """Q6_K super-blocks (S, 210) -> q (S * 8, 32) uint8, d, m (S * 8,) fp32 of fp16."""
    ql = (b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1))
    qh = (b[:, 128:192].reshape(-1, 2, 1, 32)
          >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1))
    q = ((ql & np.uint8(15)).reshape(-1, 8, 32) | ((qh & np.uint8(3)) << np.uint8(4)).reshape(
        -1, 8, 32)).reshape(-1, 32).astype(np.float32) - 32  # (B, 32) in -32..31
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)  # (S, 16): a scale per 16
    step = torch.from_numpy((_f16(b[:, 208:210])[:, None].numpy() * sc).reshape(-1, 2))
    q = torch.from_numpy(q)
    w = (q.reshape(-1, 2, 16) * step[..., None]).reshape(-1, 32)  # gguf's dequantization
    # (a) the larger-|scale| half's scale for both halves, the other rounded to it
    dom = torch.where(step[:, 0].abs() >= step[:, 1].abs(), step[:, 0], step[:, 1])
    da = dom.half().float()
    ratio = torch.where(dom[:, None] != 0, step / torch.where(dom != 0, dom, 1)[:, None], 0)
    qa = ((q.reshape(-1, 2, 16) * ratio[..., None]).round().clamp(-32, 31) + 32).reshape(-1, 32)
    ma = (-32 * da).half().float()
    # (b) min / max
    lo, hi = w.amin(-1), w.amax(-1)
    db = ((hi - lo) / 63).half().float()
    mb = lo.half().float()
    inv = torch.where(db > 0, 1 / torch.where(db > 0, db, 1), 0)
    qb = ((w - mb[:, None]) * inv[:, None]).round().clamp(0, 63)
    if not all(torch.isfinite(t).all() for t in (da, ma, db, mb)):
        return None
    err_a = (qa * da[:, None] + ma[:, None] - w).abs().amax(-1)
    err_b = (qb * db[:, None] + mb[:, None] - w).abs().amax(-1)
    pick_a = err_a <= err_b
    qv = torch.where(pick_a[:, None], qa, qb).to(torch.uint8).numpy()
    return qv, torch.where(pick_a, da, db), torch.where(pick_a, ma, mb)


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


def _q8_from_q4x(parts: tuple[Any, ...]) -> tuple[Any, ...]:
    """Q4 / Q5 / Q6 parts -> Q8 parts of the weights they hold, requantized."""
    if parts[0] == "q4k":  # w = d sc q - dmin mn per sub-block of 32
        _, qs, d, dmin, sc, mn = (torch.as_tensor(np.asarray(p)) if i else p
                                  for i, p in enumerate(parts))
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # (N, nb, 32)
        n, nb = q.shape[:2]
        scale = (d[..., None] * sc.float()).reshape(n, nb)
        low = (-dmin[..., None] * mn.float()).reshape(n, nb)
        return ("q8", *_q8(q * scale[..., None] + low[..., None]))
    kind, q, d, m = parts
    q = np.asarray(q)
    if kind == "q4":
        q = np.concatenate([q & 15, q >> 4], axis=-1)
    w = torch.from_numpy(q.astype(np.float32)) * d[..., None] + m[..., None]  # (N, nb, 32)
    return ("q8", *_q8(w))


def _f16(two_bytes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(
        np.float32))
