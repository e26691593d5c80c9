"""Rows of a weight read back from its kernel records (q4q8_gemv.c's layouts), in fp32.

What a tied token embedding looks up when the LM head's records are its only copy
(embedding.RecordsEmbedding): the weights the kernel multiplies, w = d q + m (Q4, and
Q5 / Q6 with their high bits) or w = d q (Q8), each a few fp32 operations on fp16 d, m, exactly as the records hold
them. A lookup reads only its rows' records (vectorized gathers, no table).
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.kernels import q4q8_gemv

QK = 32
ROWS = q4q8_gemv.ROWS


def _q_index(fmt: int, r: np.ndarray) -> np.ndarray:
    """(n, 32) byte offsets in a record of row r's 32 quants (Q8: the bytes; Q4: the bytes
    whose low nibble holds inputs 0..15 and high nibble 16..31, as index k and k + 16)."""
    k = np.arange(QK if fmt == q4q8_gemv.FORMAT_Q8 else QK // 2)
    return 64 * (k // 4)[None, :] + 4 * r[:, None] + (k % 4)[None, :]


def _fp16_at(rec: np.ndarray, offset: int, r: np.ndarray) -> np.ndarray:
    """(n, nb, record) records -> (n, nb) fp32: row r's fp16 at offset + 2 r."""
    idx = (offset + 2 * r)[:, None, None] + np.arange(2)[None, None, :]
    two = np.take_along_axis(rec, np.broadcast_to(idx, (len(r), rec.shape[1], 2)), axis=2)
    return np.ascontiguousarray(two).view(np.float16)[..., 0].astype(np.float32)


def rows_of_records(packed: torch.Tensor, fmt: int, in_features: int,
                    ids: np.ndarray) -> np.ndarray:
    """Rows `ids` (n,) of the weight whose records are `packed` (fmt, in_features) ->
    (n, in_features) fp32."""
    segments = q4q8_gemv.segments(packed, fmt, in_features)
    out = np.empty((len(ids), in_features), np.float32)
    ids = np.asarray(ids, np.int64)
    for first_group, groups, seg_fmt, records in segments:
        lo, hi = first_group * ROWS, (first_group + groups) * ROWS
        at = np.nonzero((ids >= lo) & (ids < hi))[0]
        if len(at):
            out[at] = _rows(records, seg_fmt, in_features, ids[at] - lo)
    return out


def _rows(records: torch.Tensor, fmt: int, k: int, ids: np.ndarray) -> np.ndarray:
    if fmt == q4q8_gemv.FORMAT_Q8:  # the kernel's gather: a decode step's 16 rows of
        # Gemma 3's head in ~µs, where the gathers below take ~170 µs
        rows = q4q8_gemv.q8_record_rows(records, k, torch.from_numpy(ids))
        if rows is not None:
            return rows.numpy()
    if fmt == q4q8_gemv.FORMAT_Q4K:
        return _q4k_rows(records, k, ids)
    nb = k // QK
    size = q4q8_gemv.RECORD_BYTES[fmt]
    rec = records.numpy().reshape(-1, nb, size)[ids // ROWS]  # (n, nb, record)
    r = ids % ROWS
    idx = _q_index(fmt, r)[:, None, :]
    raw = np.take_along_axis(rec, np.broadcast_to(idx, (len(ids), nb, idx.shape[2])), axis=2)
    if fmt == q4q8_gemv.FORMAT_Q8:
        q = raw.astype(np.float32) - 128  # (n, nb, 32)
        d = _fp16_at(rec, 8 * 64, r)
        return (d[..., None] * q).reshape(len(ids), k)
    q = np.concatenate([raw & 15, raw >> 4], axis=-1).astype(np.float32)  # (n, nb, 32)
    q += _high_bits(rec, fmt, r)
    d, m = _fp16_at(rec, 256, r), _fp16_at(rec, 288, r)
    return (d[..., None] * q + m[..., None]).reshape(len(ids), k)


def _q4k_rows(records: torch.Tensor, k: int, ids: np.ndarray) -> np.ndarray:
    """FMT_Q4K records' rows: w = (d sc) q + (-dmin mn) per sub-block of 32, the fp32
    products the kernel takes (q4q8_gemv.c q4k_scales)."""
    s, n = k // 256, len(ids)
    rec = records.numpy().reshape(-1, s, 2304)[ids // ROWS]  # (n, S, super-block)
    r = ids % ROWS
    nibbles = rec[..., :2048].reshape(n, 8 * s, 256)  # each sub-block a Q4 record's bytes
    idx = _q_index(q4q8_gemv.FORMAT_Q4, r)[:, None, :]
    raw = np.take_along_axis(nibbles, np.broadcast_to(idx, (n, 8 * s, idx.shape[2])), axis=2)
    q = np.concatenate([raw & 15, raw >> 4], axis=-1).astype(np.float32).reshape(n, s, 8, QK)
    meta = rec[..., 2048:]
    d, dmin = _fp16_at(meta, 0, r), _fp16_at(meta, 32, r)  # (n, S)
    j = np.arange(8)
    at = np.concatenate([64 + 16 * j[None, :] + r[:, None],
                         192 + 16 * (j % 4)[None, :] + r[:, None]], axis=1)  # (n, 16)
    raw = np.take_along_axis(meta, np.broadcast_to(at[:, None, :], (n, s, 16)), axis=2)
    lows, highs = raw[..., :8], raw[..., 8:] >> (4 * (j // 4)).astype(np.uint8)
    sc = ((lows & 15) | ((highs & 3) << 4)).astype(np.float32)
    mn = ((lows >> 4) | (((highs >> 2) & 3) << 4)).astype(np.float32)
    wd, wm = d[..., None] * sc, -dmin[..., None] * mn  # (n, S, 8)
    return (q * wd[..., None] + wm[..., None]).reshape(n, k)


def _high_bits(rec: np.ndarray, fmt: int, r: np.ndarray) -> np.ndarray | float:
    """A Q5 / Q6 record's high bits of row r's 32 quants, as values to add (n, nb, 32)
    (q4q8_gemv.c add_high512's layout); 0 for Q4."""
    hb = {q4q8_gemv.FORMAT_Q5: 1, q4q8_gemv.FORMAT_Q6: 2}.get(fmt, 0)
    if not hb:
        return 0.0
    per = 16 * hb  # plane bytes a chunk
    k = np.arange(QK // 2)
    i = 4 * r[:, None] + (k % 4)[None, :]  # (n, 16): the byte of the chunk k // 4
    idx = 320 + per * (k // 4)[None, :] + i % per
    raw = np.take_along_axis(rec, np.broadcast_to(idx[:, None, :], (len(r), rec.shape[1], 16)),
                             axis=2)
    e = (raw >> (2 * hb * (i // per))[:, None, :].astype(np.uint8)) & ((1 << 2 * hb) - 1)
    high = np.concatenate([e & ((1 << hb) - 1), e >> hb], axis=-1)
    return (high.astype(np.float32) * 16)
