"""Paged prefill/extend over the flat varlen batch, one launch per step.

Grid (prefill tiles, heads): a tile is PREFILL_BLOCK_M consecutive new queries
of one sequence (the plan's work list). Query i of a sequence sits at position
ctx + i, where ctx = seq_len - query_len is its cached prefix (a prefix-cache
hit or earlier chunks); it attends to every key up to its own position, all read
through the block table (this step's K/V are already in the pool). Key tiles
wholly before the tile's first query need no causal mask; the rest are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.attention.triton.plan import (
    NO_WINDOW,
    PREFILL_BLOCK_M,
    PREFILL_BLOCK_N,
    TritonPlan,
    launch_options,
)
from tokenmill.attention.triton.tile import attend_tile, kv_tile_offsets
from tokenmill.kernels.spec import KernelSpec


@triton.jit(do_not_specialize=["group", "block_size", "window", "stride_bt"])
def prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tile_seqs_ptr, tile_starts_ptr,
                   query_start_ptr, seq_lens_ptr, block_tables_ptr,
                   scale_log2, group, block_size, window,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_slot, stride_head,
                   stride_bt,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    b = tl.load(tile_seqs_ptr + tile)
    m0 = tl.load(tile_starts_ptr + tile)
    q_begin = tl.load(query_start_ptr + b)
    query_len = tl.load(query_start_ptr + b + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - query_len
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < query_len
    q_pos = ctx + offs_m  # (BLOCK_M,)
    rows = (q_begin + offs_m).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)

    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    # keys before ctx + m0 (the tile's first query) are causally visible to every row;
    # a local layer (window < NO_WINDOW) starts at the first key its first row sees
    # and masks q_pos - pos >= window in every tile
    full_end = ((ctx + m0) // BLOCK_N) * BLOCK_N
    first = (tl.maximum(ctx + m0 - window + 1, 0) // BLOCK_N) * BLOCK_N
    for n0 in range(first, full_end, BLOCK_N):
        pos, valid, offs = kv_tile_offsets(table, n0, seq_len, block_size, kv_head,
                                           stride_slot, stride_head, HEAD_DIM, BLOCK_N)
        k = tl.load(k_cache_ptr + offs).to(q.dtype)  # every position < full_end <= seq_len
        v = tl.load(v_cache_ptr + offs).to(q.dtype)
        visible = valid[None, :] & (q_pos[:, None] - pos[None, :] < window)
        m, l, acc = attend_tile(q, k, v, m, l, acc, visible, scale_log2)
    # the diagonal: up to the tile's last query position
    end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
    for n0 in range(full_end, end, BLOCK_N):
        pos, valid, offs = kv_tile_offsets(table, n0, end, block_size, kv_head,
                                           stride_slot, stride_head, HEAD_DIM, BLOCK_N)
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0).to(q.dtype)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None]) \
            & (q_pos[:, None] - pos[None, :] < window)
        m, l, acc = attend_tile(q, k, v, m, l, acc, visible, scale_log2)

    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out: torch.Tensor, plan: TritonPlan, scale: float,
                  sliding_window: int | None = None) -> None:
    """Attention of the plan's prefill rows of q (T, heads, D) into the same rows of out."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    prefill_kernel[(plan.num_tiles, num_heads)](
        q, k_cache, v_cache, out, plan.tile_seqs, plan.tile_starts, plan.query_start_loc,
        plan.seq_lens, plan.block_tables, scale * 1.4426950408889634, group, plan.block_size,
        sliding_window or NO_WINDOW, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(1),
        k_cache.stride(2), plan.block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N,
        **launch_options("prefill"))


def compile_specs(dtype: str, head_dim: int) -> list[KernelSpec]:
    """The one prefill variant per dtype and
    head_dim; GQA group and block size are runtime ints."""
    ptr, i32 = f"*{dtype}", "i32"
    sig = {"q_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr, "out_ptr": ptr,
           "tile_seqs_ptr": "*i32", "tile_starts_ptr": "*i32", "query_start_ptr": "*i32",
           "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32", "scale_log2": "fp32",
           "group": i32, "block_size": i32, "window": i32,
           **dict.fromkeys(["stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_slot",
                            "stride_head", "stride_bt"], i32),
           **dict.fromkeys(["HEAD_DIM", "BLOCK_M", "BLOCK_N"], "constexpr")}
    const = {"HEAD_DIM": head_dim, "BLOCK_M": PREFILL_BLOCK_M, "BLOCK_N": PREFILL_BLOCK_N}
    # two key loops (before the diagonal, on it) of two dots each
    return [KernelSpec("prefill", prefill_kernel, sig, const, launch_options("prefill"), dots=4)]
