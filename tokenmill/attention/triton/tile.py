"""One step of the online softmax shared by the decode and prefill kernels.

Both kernels read K/V through the block table in tiles of BLOCK_N token
positions; a tile may straddle pages (any block size works), and positions past
`limit` are never loaded, so a NaN in an unused slot cannot reach a dot product.
Scores are in log2 units (`scale_log2` = softmax scale * log2(e)) so the
kernels use exp2.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_tile_offsets(block_table_row, n0, limit, block_size, kv_head, stride_slot, stride_head,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offsets (BLOCK_N, HEAD_DIM) of token positions n0.. of one sequence
    in a (num_blocks, block_size, kv_heads, head_dim) pool, and their mask."""
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < limit
    block = tl.load(block_table_row + pos // block_size, mask=valid, other=0)
    slot = block.to(tl.int64) * block_size + pos % block_size  # int64: pools pass 2**31 elements
    offs = slot[:, None] * stride_slot + kv_head * stride_head + tl.arange(0, HEAD_DIM)[None, :]
    return pos, valid, offs


@triton.jit
def attend_tile(q, k, v, m, l, acc, visible, scale_log2):
    """q: (M, D); k, v: (N, D); visible: (M, N) or (1, N) bool; m, l: (M,) fp32 running
    max and sum (log2 units); acc: (M, D) fp32. Returns the updated (m, l, acc)."""
    s = tl.dot(q, tl.trans(k)) * scale_log2  # (M, N) fp32
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # a row that has seen no visible key yet keeps m = -inf; exp2(-inf - -inf) is NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc
