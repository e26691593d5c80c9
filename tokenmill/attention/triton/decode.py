"""Paged decode: one query token per sequence, flash-decoding style.

Grid (decodes, kv_heads * head_chunks, splits). One program holds up to
DECODE_BLOCK_H query heads of one KV-head group (padded to 16 rows so the dots
map to tensor cores), so each K/V tile is read once per group, not once per
head. With split-K each split covers `split_len` positions of the sequence and
writes a partial (normalised output, log2-sum-exp) that `reduce_kernel`
combines; without it the kernel writes the output directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.attention.triton.plan import (
    DECODE_BLOCK_H,
    DECODE_BLOCK_N,
    NO_WINDOW,
    REDUCE_CHUNK,
    TritonPlan,
    launch_options,
)
from tokenmill.attention.triton.tile import attend_tile, kv_tile_offsets
from tokenmill.kernels.spec import KernelSpec

# ints that vary at run time are not specialised (no == 1 or % 16 variants), so one
# binary serves every GQA group, block size and split; the other strides are
# multiples of head_dim and so of 16
_PART_STRIDES = ["stride_pd", "stride_ph", "stride_ps"]


@triton.jit(do_not_specialize=["group", "block_size", "split_len", "window", "stride_bt",
                               *_PART_STRIDES])
def decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
                  decode_seqs_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
                  scale_log2, group, block_size, split_len, window,
                  stride_qt, stride_qh, stride_ot, stride_oh, stride_slot, stride_head,
                  stride_bt, stride_pd, stride_ph, stride_ps,
                  HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  SPLIT: tl.constexpr):
    i = tl.program_id(0)
    chunks = tl.cdiv(group, BLOCK_H)
    kv_head = tl.program_id(1) // chunks
    split = tl.program_id(2)
    in_group = (tl.program_id(1) % chunks) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = in_group < group
    heads = kv_head * group + in_group  # (BLOCK_H,)
    b = tl.load(decode_seqs_ptr + i)
    row = tl.load(query_start_ptr + b)
    seq_len = tl.load(seq_lens_ptr + b)
    # a local layer sees the last `window` keys (NO_WINDOW: all): a split wholly before
    # them is empty and the reduce gives it no weight
    end = tl.minimum(seq_len, split * split_len + split_len)
    start = tl.maximum(split * split_len, seq_len - window)
    d = tl.arange(0, HEAD_DIM)

    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None], other=0.0)  # (BLOCK_H, D)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        _, valid, offs = kv_tile_offsets(table, n0, end, block_size, kv_head, stride_slot,
                                         stride_head, HEAD_DIM, BLOCK_N)
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0).to(q.dtype)
        m, l, acc = attend_tile(q, k, v, m, l, acc, valid[None, :], scale_log2)

    o = acc / tl.where(l > 0, l, 1.0)[:, None]  # an empty split (short sequence) stays 0
    if SPLIT:
        part = i * stride_pd + heads * stride_ph + split * stride_ps  # (BLOCK_H,)
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=head_ok[:, None])
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=head_ok)
    else:
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


@triton.jit(do_not_specialize=["num_splits", "split_len", *_PART_STRIDES])
def reduce_kernel(part_o_ptr, part_lse_ptr, out_ptr, decode_seqs_ptr, query_start_ptr,
                  seq_lens_ptr, num_splits, split_len, stride_ot, stride_oh, stride_pd,
                  stride_ph, stride_ps, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    # grid: (decodes, heads); combines the splits of one head of one sequence that hold
    # keys (a captured graph's plan has splits for max_model_len; a short sequence
    # fills the first few), CHUNK at a time with a running max
    i = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(decode_seqs_ptr + i)
    row = tl.load(query_start_ptr + b)
    used = tl.minimum(num_splits, tl.maximum(1, tl.cdiv(tl.load(seq_lens_ptr + b), split_len)))
    d = tl.arange(0, HEAD_DIM)
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, used, CHUNK):
        s = s0 + tl.arange(0, CHUNK)
        part = i * stride_pd + h * stride_ph + s * stride_ps  # (CHUNK,)
        lse = tl.load(part_lse_ptr + part, mask=s < used, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))  # the first split always holds keys
        # empty splits (past the end, or before a sliding window) weigh 0; while every
        # split so far is empty m_new is -inf, and exp2(-inf - -inf) would be NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(lse - m_safe)
        alpha = tl.exp2(m - m_safe)
        o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :],
                    mask=(s < used)[:, None], other=0.0)  # (CHUNK, D)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        l = l * alpha + tl.sum(w, 0)
        m = m_new
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d,
             (acc / l).to(out_ptr.dtype.element_ty))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor, plan: TritonPlan, scale: float,
                 sliding_window: int | None = None) -> None:
    """Attention of the plan's decode rows of q (T, heads, D) into the same rows of out;
    sliding_window: each row sees only its last that many keys."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    n, splits = plan.num_decodes, plan.num_splits
    grid = (n, num_kv_heads * triton.cdiv(group, DECODE_BLOCK_H), splits)
    if splits > 1:
        part_o = torch.empty((n, num_heads, splits, head_dim), dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty((n, num_heads, splits), dtype=torch.float32, device=q.device)
        part_strides = (num_heads * splits, splits, 1)  # in units of one (split) row
    else:
        part_o = part_lse = plan.dummy  # not read
        part_strides = (0, 0, 0)
    decode_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_lse,
        plan.decode_seqs, plan.query_start_loc, plan.seq_lens, plan.block_tables,
        scale * 1.4426950408889634, group, plan.block_size, plan.split_len,
        sliding_window or NO_WINDOW, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(1), k_cache.stride(2), plan.block_tables.stride(0), *part_strides,
        HEAD_DIM=head_dim, BLOCK_H=DECODE_BLOCK_H, BLOCK_N=DECODE_BLOCK_N, SPLIT=splits > 1,
        **launch_options("decode"))
    if splits > 1:
        reduce_kernel[(n, num_heads)](
            part_o, part_lse, out, plan.decode_seqs, plan.query_start_loc, plan.seq_lens,
            splits, plan.split_len, out.stride(0), out.stride(1), *part_strides,
            HEAD_DIM=head_dim, CHUNK=REDUCE_CHUNK)


def compile_specs(dtype: str, head_dim: int) -> list[KernelSpec]:
    """Every variant the backend launches for
    q/KV of `dtype` and head_dim: decode with and without split-K, and the reduce.
    GQA group, block size and split length are runtime ints (one binary for all)."""
    ptr, i32 = f"*{dtype}", "i32"
    sig = {"q_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr, "out_ptr": ptr,
           "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "decode_seqs_ptr": "*i32",
           "query_start_ptr": "*i32", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32",
           "scale_log2": "fp32", "group": i32, "block_size": i32, "split_len": i32,
           "window": i32, **dict.fromkeys(["stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_slot",
                            "stride_head", "stride_bt", "stride_pd", "stride_ph", "stride_ps"],
                           i32),
           **dict.fromkeys(["HEAD_DIM", "BLOCK_H", "BLOCK_N", "SPLIT"],
                           "constexpr")}
    const = {"HEAD_DIM": head_dim, "BLOCK_H": DECODE_BLOCK_H, "BLOCK_N": DECODE_BLOCK_N}
    reduce_sig = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": ptr,
                  "decode_seqs_ptr": "*i32", "query_start_ptr": "*i32",
                  "seq_lens_ptr": "*i32", "num_splits": i32, "split_len": i32,
                  **dict.fromkeys(["stride_ot", "stride_oh", "stride_pd", "stride_ph",
                                   "stride_ps"], i32),
                  "HEAD_DIM": "constexpr", "CHUNK": "constexpr"}
    opts = launch_options("decode")
    return [KernelSpec("decode", decode_kernel, sig, {**const, "SPLIT": False}, opts, dots=2),
            KernelSpec("decode_split", decode_kernel, sig, {**const, "SPLIT": True}, opts,
                       dots=2),
            KernelSpec("decode_reduce", reduce_kernel, reduce_sig,
                       {"HEAD_DIM": head_dim, "CHUNK": REDUCE_CHUNK})]
