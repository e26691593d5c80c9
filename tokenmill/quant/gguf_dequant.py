"""GGUF blocks -> float32 with the gguf package's own arithmetic, in large chunks.

`gguf.quants.dequantize` runs its vectorised per-type code over groups of 16 rows, so
a big tensor costs thousands of small numpy calls (Gemma 3's 262,144-row embedding:
16,384 groups); the same `dequantize_rows` over ~1 MiB of output at a time gives the
same values 2-3x faster (issue 60: start-up). Types gguf does not implement raise
NotImplementedError, as `gguf.quants.dequantize` does.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

_CHUNK_BYTES = 1 << 20  # output per call: fits in L2 with its temporaries (measured best)


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """raw: uint8 (..., bytes per row) blocks, or a typed F32/F16 array -> float32 of
    the dequantized shape (what gguf.quants.dequantize returns)."""
    qtype = GGMLQuantizationType(qtype)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return gguf_quants.dequantize(raw, qtype)
    kind = getattr(gguf_quants, qtype.name, None)
    if kind is None or not hasattr(kind, "dequantize_rows"):
        return gguf_quants.dequantize(raw, qtype)  # raises NotImplementedError by name
    kind.init_grid()  # the IQ types' lookup tables, as gguf's own path does first
    rows = raw.reshape(-1, raw.shape[-1])
    cols = rows.shape[1] // kind.type_size * kind.block_size
    out = np.empty((rows.shape[0], cols), np.float32)
    step = max(1, _CHUNK_BYTES // (cols * 4))
    for r0 in range(0, rows.shape[0], step):
        out[r0:r0 + step] = kind.dequantize_rows(rows[r0:r0 + step])
    return out.reshape(*raw.shape[:-1], cols)


def dequantize_torch(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor | None:
    """Q4_0 / Q4_1 / Q8_0 blocks (uint8 (..., bytes per row)) -> float32 with torch's
    vectorised, threaded ops: gguf's formulas (d * q, d * q + m, each product and sum
    rounded to fp32 as numpy rounds them), so the same values; None for other types.
    These types are most of a small model's load, and numpy's dequantization of them
    ran single-threaded at ~0.2 GB/s."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in _TORCH_TYPES:
        return None
    block, type_size = GGML_QUANT_SIZES[qtype]
    with warnings.catch_warnings():  # read-only file pages: only read here
        warnings.simplefilter("ignore", UserWarning)
        b = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1, type_size))  # (blocks, bytes)
    d = b[:, 0:2].contiguous().view(torch.float16).float()  # (blocks, 1)
    if qtype == GGMLQuantizationType.Q8_0:
        w = b[:, 2:].view(torch.int8).float() * d
    else:
        qs = b[:, -16:]
        q = torch.cat([qs & 15, qs >> 4], dim=1)  # (blocks, 32): low nibbles first
        if qtype == GGMLQuantizationType.Q4_0:
            w = (q.to(torch.int8) - 8).float() * d
        else:
            w = q.float() * d + b[:, 2:4].contiguous().view(torch.float16).float()
    return w.reshape(*raw.shape[:-1], raw.shape[-1] // type_size * block)


_TORCH_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                GGMLQuantizationType.Q8_0)
