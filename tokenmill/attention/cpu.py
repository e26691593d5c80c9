"""The `cpu` attention backend: the native C kernels and the fast torch path for
a paged KV cache on the CPU.

Same contract as the `torch` backend's `paged_attention_reference`, fewer and
cheaper ops:
- decode rows (one query each) of all sequences, with a bf16 cache, go to the
  native kernel (tokenmill/kernels/paged_decode.c), which reads each
  sequence's blocks in place through its block table: no copy of any K/V;
- elsewhere (fp32, no C compiler) they go through one gather per pool into
  reused scratch and three batched ops (scores, softmax, weighted sum), with
  grouped-query heads handled by a reshape instead of repeating K/V per query
  head, and no flash-attention kernel (whose fixed cost dominates a single
  query);
- blocks all decode rows share (a cached system prompt) are attended once for
  the whole batch, not read again per sequence: with the native kernel inside its
  one call (tm_cascade_decode_bf16: shared blocks, own blocks, the merge), else by
  one matmul;
- a prompt chunk, a whole prompt or one over a cached prefix, goes through the tiled
  native kernel (tm_prompt_attend_bf16: 16 queries' heads in vector lanes against
  their keys, read in place, masked after the diagonal); past its key limit, or with
  TOKENMILL_PROMPT_TILED=0, one over a cached prefix takes the shared-prefix decode
  call (each new token a row) and any chunk the native decode kernel row by row; past
  their size limits (and on fp32) a whole prompt attends with SDPA to this step's own
  K/V, not a copy gathered back out of the cache;
- a sequence whose blocks are consecutive reads its K/V as a view of the pool,
  so only fragmented block tables pay for a gather.

The KV layout is the torch backend's head-major one, (kv_heads, num_blocks,
block_size, head_dim). What every layer of a step shares (the block tables as
lists, how a mixed step splits, the decode gather indices) is `CpuBackend.plan`,
built once per step.
"""

from __future__ import annotations

import math
import os
from typing import ClassVar

import torch
import torch.nn.functional as F

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.torch_ref import kv_cache_shape, store_kv_torch
from tokenmill.attention.window import windowed_paged_attention
from tokenmill.kernels import paged_decode as native


def _seq_kv(cache: torch.Tensor, table: list[int], seq_len: int) -> torch.Tensor:
    """(kv_heads, seq_len, head_dim) of one sequence: a view when its blocks are consecutive."""
    block_size = cache.shape[2]
    n = -(-seq_len // block_size)
    first = table[0]
    if table[n - 1] - first == n - 1 and all(b == first + i for i, b in enumerate(table[:n])):
        return cache[:, first:first + n].flatten(1, 2)[:, :seq_len]
    idx = torch.tensor(table[:n], dtype=torch.int64, device=cache.device)
    return cache.index_select(1, idx).flatten(1, 2)[:, :seq_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            causal_offset: int | None) -> torch.Tensor:
    """q (Q, heads, d); k, v (kv_heads, L, d). causal_offset: query i sees keys
    0..offset+i (None: all keys). Returns (Q, heads, d)."""
    num_q, heads, d = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    if num_q == 1:  # fp32: small bf16 matmuls are slower on CPU than fp32 ones
        qg = q.view(kv_heads, group, d).float()  # (kv, g, d)
        probs = torch.softmax(torch.bmm(qg, k.float().transpose(1, 2)).mul_(scale), dim=-1)
        return torch.bmm(probs, v.float()).view(1, heads, d).to(q.dtype)
    gqa: dict[str, bool] = {}
    if group > 1 and _SDPA_GQA:
        # the kernel maps query heads to kv heads itself: no repeated copy of K/V (the same
        # bits, 1.1x faster on a 512-token prompt and 1.4x on 64 new tokens over a
        # 1,024-token cached prefix, SmolLM2's heads, 1 thread, under load)
        gqa = {"enable_gqa": True}
    elif group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    # 4-D (1, heads, L, d): torch's CPU SDPA runs 3-D inputs 2-3x slower (measured
    # at 272-1,024 tokens, causal or masked, bf16)
    qt, kt, vt = q.transpose(0, 1)[None], k.to(q.dtype)[None], v.to(q.dtype)[None]
    if causal_offset is None or causal_offset == 0 and num_q == k.shape[1]:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal_offset is not None,
                                             scale=scale, **gqa)
    else:
        q_pos = torch.arange(causal_offset, causal_offset + num_q, device=q.device)
        mask = torch.arange(k.shape[1], device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, **gqa)
    return out[0].transpose(0, 1)


# scaled_dot_product_attention(enable_gqa=...) is torch 2.5's
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


class _Workspace:
    """Grow-only scratch for the decode gathers, reused by every layer and step:
    a fresh multi-megabyte tensor per layer costs more in page faults than the
    copy into it (measured 2.5-3x slower at 50 sequences x 400 tokens)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        numel = math.prod(shape)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            # a normal tensor even when first needed under inference_mode: an inference
            # tensor could not be written by a later call outside it
            with torch.inference_mode(False):
                buf = torch.empty(max(numel, 1 << 16), dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:numel].view(shape)


_workspace = _Workspace()


# a batch's decode rows attend to blocks they all share once, as one matmul, when
# there are at least this many (below it the extra ops cost more than the gather)
MIN_SHARED_BLOCKS = 4

# with the native kernel the shared blocks, each sequence's own blocks and their merge
# are one call (tm_cascade_decode_bf16); TOKENMILL_CASCADE_NATIVE=0 keeps the torch
# matmul and torch merge for the shared part instead (for A/B runs)
CASCADE_NATIVE = os.environ.get("TOKENMILL_CASCADE_NATIVE", "1") not in ("0", "false", "no",
                                                                       "off")
# ... taken over paged_decode reading each sequence's whole table only from this many
# shared blocks and sequences: the same FLOPs either way, and its 16 query lanes part
# empty below ~8 x 3 queries (benchmarks/kernels/cascade_decode.py --sweep-blocks, SmolLM2's
# heads, block size 16, 1 thread, under load: 16 seqs 0.97x at 4 blocks, 1.06x at 8,
# 1.45x at 64; 8 seqs 0.97x at 8, 1.03x at 16; 2-4 seqs 0.6-0.9x at any length)
MIN_CASCADE_BLOCKS = 8
MIN_CASCADE_SEQS = 8
# a prompt chunk over a cached prefix goes the same way, from MIN_CASCADE_SEQS up to
# this many new tokens (vs SDPA, 1 thread, under load: 2.3-2.9x at 16-128 new tokens
# over 128-1,024 cached ones, 2.0x at 512 over 512, 1.5x at 1,024 over 1,024, its
# causal part per row then growing; the scratch grows with the square)
MAX_EXTEND_QUERIES = 512
# _prompt_native's scores scratch is Q x heads x seq_len fp32: at most this many Q x
# seq_len (a 512-token prompt over a 128-token prefix: ~12 MB with 9 heads)
MAX_PROMPT_SCORES = 512 * 640
# every prompt chunk, whole prompt or over a cached prefix, goes first to the tiled
# kernel (tm_prompt_attend_bf16: 16-query tiles, queries in vector lanes), up to this
# many keys (its scratch: ~0.3 KB per key and thread with 9 / 3 heads). SmolLM2's heads,
# 2 threads, against the row-by-row decode kernel: 1.6x at 32 tokens, 2.2x at 256-512;
# against the cascade kernel over a cached prefix: 1.25x at 16 new tokens over 1,024,
# 1.9-2.0x at 256-512; against SDPA 3.3x at 1,024 over 1,024 (BENCHMARKS.md).
# TOKENMILL_PROMPT_TILED=0 keeps the paths below it (for A/B runs)
PROMPT_TILED = os.environ.get("TOKENMILL_PROMPT_TILED", "1") not in ("0", "false", "no", "off")
MAX_TILED_KEYS = 16384


def use_native(k_cache: torch.Tensor) -> bool:
    """Whether decode rows go to the native kernel: a bf16 CPU cache and a kernel built."""
    return (k_cache.dtype == torch.bfloat16 and k_cache.device.type == "cpu"
            and native.available())


def shared_blocks(rows: list[list[int]], seq_lens: list[int], block_size: int) -> int:
    """How many leading blocks every row's block table holds at the same place (each
    row keeping at least one token of its own after them)."""
    shared = 0
    if len(rows) > 1:
        limit = (min(seq_lens) - 1) // block_size
        first = rows[0]
        while shared < limit and all(r[shared] == first[shared] for r in rows):
            shared += 1
    return shared


def takes_cascade(shared: int, num_seqs: int) -> bool:
    """Whether decode rows with `shared` common blocks go to the native cascade call."""
    return CASCADE_NATIVE and shared >= MIN_CASCADE_BLOCKS and num_seqs >= MIN_CASCADE_SEQS


class _DecodePlan:
    """What every layer's batched decode attention needs, derived once per step.

    With the native kernel (tokenmill/kernels/paged_decode.c: bf16 cache on a CPU
    where it builds) each sequence's own blocks are read in place through its
    table; otherwise they are gathered into scratch for two batched matmuls.

    Blocks that every sequence of the batch has at the same place in its table
    (a prefix-cache hit on a shared system prompt, or n > 1 siblings) are
    attended once for all queries: by the native cascade call (from
    MIN_CASCADE_BLOCKS blocks and MIN_CASCADE_SEQS sequences), else one
    (kv, B * g, P) matmul (from MIN_SHARED_BLOCKS) instead of gathering the same
    prefix B times; each sequence's own blocks after it are read as before, and
    the two softmax parts are merged exactly (shared maximum, one denominator)."""

    def __init__(self, tables: torch.Tensor, seq_lens: list[int], k_cache: torch.Tensor
                 ) -> None:
        kv_heads, pool_blocks, block_size, _ = k_cache.shape
        device = k_cache.device
        rows = tables.tolist()
        shared = shared_blocks(rows, seq_lens, block_size)
        self.native = use_native(k_cache)
        if self.native and CASCADE_NATIVE:
            enough = takes_cascade(shared, len(rows))
        else:
            enough = shared >= MIN_SHARED_BLOCKS
        self.shared = shared if enough else 0
        self.shared_table = rows[0][:self.shared]
        own = [n - self.shared * block_size for n in seq_lens]
        n_blocks = -(-max(own) // block_size)
        self.span = n_blocks * block_size
        if self.native:  # the kernel walks the block table itself
            self.tables = tables.to(torch.int32).contiguous()
            self.own_lens = torch.tensor(own, dtype=torch.int32)
        # for the gather path (also the fallback should the kernel decline a shape):
        # block b of head h is row h * pool_blocks + b of the pool seen as
        # (kv * blocks, bs * d): a dim-0 gather of whole rows, 2x faster than
        # index_select along dim 1
        own_tables = tables[:, self.shared:self.shared + n_blocks].reshape(1, -1).long()
        heads = torch.arange(0, kv_heads * pool_blocks, pool_blocks, device=device)
        self.idx = (own_tables + heads[:, None]).reshape(-1)
        lens = torch.tensor(own, device=device)
        self.pad = torch.arange(self.span, device=device)[None, :] >= lens[:, None]  # (B, S)


def _prefix_scores(qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   plan: _DecodePlan, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled scores of every decode row against the blocks all rows share, fp32
    (kv, B, g, P), one matmul for the batch, and those blocks' V (kv, P, d).
    qg: the queries (kv, B, g, d) in the cache dtype."""
    kv_heads, num_seqs, group, d = qg.shape
    prefix_len = plan.shared * k_cache.shape[2]
    kp = _seq_kv(k_cache, plan.shared_table, prefix_len)  # (kv, P, d)
    vp = _seq_kv(v_cache, plan.shared_table, prefix_len)
    sp = torch.bmm(qg.reshape(kv_heads, num_seqs * group, d), kp.transpose(1, 2))
    return sp.float().mul_(scale).view(kv_heads, num_seqs, group, prefix_len), vp


def _prefix_values(weights: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
    """sum_t w_t v_t over the shared blocks: weights (kv, B, g, P) -> fp32 (kv, B, g, d)."""
    kv_heads, num_seqs, group, prefix_len = weights.shape
    return torch.bmm(weights.to(vp.dtype).view(kv_heads, num_seqs * group, prefix_len),
                     vp).float().view(kv_heads, num_seqs, group, vp.shape[-1])


def _decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  plan: _DecodePlan, scale: float) -> torch.Tensor:
    """One query per sequence, all sequences at once. q (B, heads, d) -> (B, heads, d).

    One index_select per pool gathers the batch's own blocks, head-major, into
    reused scratch as (kv_heads * B, span, d): both products are then plain 3-D
    bmm calls over contiguous operands (a 4-D matmul over permuted views made
    torch copy and fold them on every call, 7x slower at 16 x 1,100 tokens).
    Both products run in the cache dtype, as transformers' eager attention does
    (an fp32 copy of K cost more than the product); masking and softmax run in
    fp32. Needs finite values in slots past each sequence's end (see ModelRunner).
    """
    num_seqs, heads, d = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group = heads // kv_heads
    if plan.native:
        result = _decode_native(q, k_cache, v_cache, plan, scale)
        if result is not None:
            return result
    rows, span = kv_heads * num_seqs, plan.span
    shape = (plan.idx.numel(), block_size * d)
    k = torch.index_select(k_cache.view(-1, block_size * d), 0, plan.idx,
                           out=_workspace.get("k", shape, k_cache.dtype, k_cache.device))
    v = torch.index_select(v_cache.view(-1, block_size * d), 0, plan.idx,
                           out=_workspace.get("v", shape, v_cache.dtype, v_cache.device))
    qg = q.view(num_seqs, kv_heads, group, d).transpose(0, 1).to(k.dtype)  # (kv, B, g, d)
    scores = torch.bmm(qg.reshape(rows, group, d), k.view(rows, span, d).transpose(1, 2))
    scores = scores.float().view(kv_heads, num_seqs, group, span)
    # slots past a sequence's end hold zeros or stale finite K/V (the model runner
    # zeroes each block on first use), so masking their scores is enough
    scores.mul_(scale).masked_fill_(plan.pad[None, :, None, :], float("-inf"))
    if not plan.shared:
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(rows, group, span)
        out = torch.bmm(probs, v.view(rows, span, d))  # (kv * B, g, d)
    else:
        sp, vp = _prefix_scores(qg, k_cache, v_cache, plan, scale)
        top = torch.maximum(scores.amax(-1, keepdim=True), sp.amax(-1, keepdim=True))
        scores.sub_(top).exp_()
        sp.sub_(top).exp_()
        denom = scores.sum(-1, keepdim=True).add_(sp.sum(-1, keepdim=True))  # (kv, B, g, 1)
        out = torch.bmm(scores.to(v.dtype).view(rows, group, span), v.view(rows, span, d))
        out = out.float().view(kv_heads, num_seqs, group, d)
        out += _prefix_values(sp, vp)
        out /= denom
    return out.view(kv_heads, num_seqs, group, d).transpose(0, 1).reshape(
        num_seqs, heads, d).to(q.dtype)


def _cascade_scratch(numel: int) -> torch.Tensor:
    return _workspace.get("cascade", (numel,), torch.float32, torch.device("cpu"))


def _decode_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   plan: _DecodePlan, scale: float) -> torch.Tensor | None:
    """`_decode_batch` through the native kernel; None if the kernel declines the shapes.
    A shared prefix is attended once for the batch: with CASCADE_NATIVE inside the one
    native call (shared blocks, own blocks and the merge); otherwise by one torch
    matmul, merged with the kernel's part through its row maxima and denominators."""
    num_seqs, heads, d = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    max_len = plan.span
    if plan.shared and CASCADE_NATIVE:
        out = native.cascade_decode(q, k_cache, v_cache, plan.tables, plan.shared,
                                    plan.own_lens, max_len, scale, _cascade_scratch)
        if out is not None:
            return out
    scratch = _workspace.get("scores", (num_seqs * heads * max_len,), torch.float32, q.device)
    part = native.paged_decode(q, k_cache, v_cache, plan.tables, plan.shared, plan.own_lens,
                               max_len, scale, scratch, with_lse=bool(plan.shared))
    if part is None:
        return None
    out, m, l_ = part
    if not plan.shared:
        return out
    qg = q.view(num_seqs, kv_heads, group, d).transpose(0, 1).to(k_cache.dtype)  # (kv, B, g, d)
    sp, vp = _prefix_scores(qg, k_cache, v_cache, plan, scale)
    m = m.view(num_seqs, kv_heads, group).transpose(0, 1).unsqueeze(-1)  # (kv, B, g, 1)
    l_ = l_.view(num_seqs, kv_heads, group).transpose(0, 1).unsqueeze(-1)
    top = torch.maximum(m, sp.amax(-1, keepdim=True))
    sp.sub_(top).exp_()
    own_scale = (m - top).exp_()  # the kernel's part was relative to its own maximum
    denom = sp.sum(-1, keepdim=True).add_(l_ * own_scale)
    shared = _prefix_values(sp, vp)
    own = out.view(num_seqs, kv_heads, group, d).transpose(0, 1)
    merged = shared.add_(own * own_scale).div_(denom)  # (kv, B, g, d)
    return merged.transpose(0, 1).reshape(num_seqs, heads, d).to(q.dtype)


def _prompt_tiled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor | None:
    """A prompt chunk q (Q, heads, d), the sequence's last Q of its seq_len tokens, all
    in the cache, through the tiled native kernel, read in place from the blocks (table:
    the sequence's row of the step's int32 block tables); None where it does not apply
    (not a bf16 CPU cache, too many keys, the kernel declines)."""
    if not (PROMPT_TILED and q.dtype == torch.bfloat16 and seq_len <= MAX_TILED_KEYS
            and use_native(k_cache)):
        return None
    return native.prompt_attend(q, k_cache, v_cache, table, seq_len, scale, _prompt_scratch)


def _prompt_scratch(numel: int) -> torch.Tensor:
    return _workspace.get("prompt_tiled", (numel,), torch.float32, torch.device("cpu"))


def _extend_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   table: list[int], seq_len: int, scale: float) -> torch.Tensor | None:
    """A prompt chunk q (Q, heads, d) over its cached prefix through the cascade kernel,
    or None where it does not pay (or the kernel declines): each new token is a row of
    the batch whose shared blocks are the prefix's full blocks, read once for all Q
    rows, and whose own tokens run from there up to itself (causal)."""
    num_q = q.shape[0]
    block_size = k_cache.shape[2]
    shared = (seq_len - num_q) // block_size
    if not (CASCADE_NATIVE and shared >= MIN_CASCADE_BLOCKS
            and MIN_CASCADE_SEQS <= num_q <= MAX_EXTEND_QUERIES and use_native(k_cache)):
        return None
    tables, lens = _causal_rows(table, seq_len, num_q, shared, block_size)
    return native.cascade_decode(q, k_cache, v_cache, tables, shared, lens, int(lens[-1]),
                                 scale, _cascade_scratch)


def _causal_rows(table: list[int], seq_len: int, num_q: int, first_block: int,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's last num_q tokens as rows of one batch: each row's table is the
    sequence's (num_q, blocks) and its length the tokens from block first_block up to
    and including its own (causal)."""
    n_blocks = -(-seq_len // block_size)
    tables = torch.tensor(table[:n_blocks], dtype=torch.int32)[None].expand(
        num_q, n_blocks).contiguous()
    last = seq_len - first_block * block_size  # the last row's length
    return tables, torch.arange(last - num_q + 1, last + 1, dtype=torch.int32)


def _prompt_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   table: list[int], seq_len: int, scale: float) -> torch.Tensor | None:
    """A prompt chunk q (Q, heads, d) whose keys are all in the cache (a whole prompt, or
    a chunk over a prefix too short for _extend_native) through the native decode
    kernel, each new token a row over the tokens up to itself (causal), read in place
    from the blocks; None where it does not apply. 1.6-2.5x faster than SDPA's causal
    flash attention at 32-1,024 tokens (SmolLM2's heads, 2 threads, quiet; BENCHMARKS.md
    "Prompt attention through the decode kernel"), within one bf16 rounding of it."""
    num_q = q.shape[0]
    if not (2 <= num_q <= MAX_EXTEND_QUERIES and num_q * seq_len <= MAX_PROMPT_SCORES
            and use_native(k_cache)):
        return None
    tables, lens = _causal_rows(table, seq_len, num_q, 0, k_cache.shape[2])
    scratch = _workspace.get("prompt_scores", (num_q * q.shape[1] * seq_len,),
                             torch.float32, q.device)
    part = native.paged_decode(q, k_cache, v_cache, tables, 0, lens, seq_len, scale, scratch)
    return None if part is None else part[0]


def plan_step(meta: AttentionMetadata, k_cache: torch.Tensor) -> _Plan | _DecodePlan:
    """What every layer of this step shares: a decode-only batch that takes the
    batched path gets its `_DecodePlan`, any other step its `_Plan`. `k_cache`
    is any layer's pool: only its geometry, dtype and device are read."""
    if meta.is_decode_only and (meta.num_seqs > 1 or use_native(k_cache)):
        return _DecodePlan(meta.block_tables, meta.seq_lens_list, k_cache)
    return _Plan(meta, k_cache)


def paged_attention_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float,
                         sliding_window: int | None = None) -> torch.Tensor:
    """q (T, heads, d); k, v (T, kv_heads, d) this step's keys/values (already stored
    in the caches). Returns (T, heads, d). A local layer in a step where some sequence
    is past its window (sliding_window set) reads just the window's blocks and masks
    in torch (attention/window.py): the native kernels take no lower key bound."""
    if sliding_window is not None:
        return windowed_paged_attention(q, k_cache, v_cache, meta, scale, sliding_window)
    plan = meta.plan
    if plan is None:  # a caller without a model runner: plan here, once for all layers
        plan = meta.plan = plan_step(meta, k_cache)
    if isinstance(plan, _DecodePlan):
        return _decode_batch(q, k_cache, v_cache, plan, scale)
    query_lens, seq_lens = meta.query_lens_list, meta.seq_lens_list
    out = torch.empty_like(q)
    start = 0
    for b, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        end = start + query_len
        if b in plan.batched_decodes:
            start = end
            continue
        qs, table, whole = q[start:end], plan.tables[b], query_len == seq_len
        # the first kernel that takes the chunk; a whole prompt skips the cascade call,
        # which needs a cached prefix
        part = _prompt_tiled(qs, k_cache, v_cache, meta.block_tables[b], seq_len, scale)
        if part is None and not whole:
            part = _extend_native(qs, k_cache, v_cache, table, seq_len, scale)
        if part is None:
            part = _prompt_native(qs, k_cache, v_cache, table, seq_len, scale)
        if part is None and whole:  # its K/V are this step's: no gather out of the cache
            part = _attend(qs, k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
                           scale, 0)
        elif part is None:
            part = _attend(qs, _seq_kv(k_cache, table, seq_len),
                           _seq_kv(v_cache, table, seq_len), scale, seq_len - query_len)
        out[start:end] = part
        start = end
    if plan.decode is not None:
        out[plan.decode_rows] = _decode_batch(q.index_select(0, plan.decode_rows), k_cache,
                                              v_cache, plan.decode, scale)
    return out


class _Plan:
    """How a mixed step splits: single-query rows batched together, the rest per sequence."""

    def __init__(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> None:
        self.tables: list[list[int]] = meta.block_tables.tolist()
        lens = meta.query_lens_list
        decodes = [b for b, n in enumerate(lens) if n == 1] if len(lens) > 1 else []
        self.batched_decodes = set(decodes) if len(decodes) > 1 else set()
        self.decode: _DecodePlan | None = None
        if self.batched_decodes:
            device = k_cache.device
            starts = meta.query_start_loc.tolist()
            self.decode_rows = torch.tensor([starts[b] for b in decodes], device=device)
            tables = meta.block_tables.index_select(0, torch.tensor(decodes, device=device))
            self.decode = _DecodePlan(tables, [meta.seq_lens_list[b] for b in decodes], k_cache)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v (T, num_kv_heads, head_dim) into the slots slot_mapping (T,) of the caches."""
    if native.store_kv(k, v, k_cache, v_cache, slot_mapping):
        return  # bf16: one native call instead of two strided index_copy_
    store_kv_torch(k, v, k_cache, v_cache, slot_mapping)


class CpuBackend(AttentionBackend):
    name: ClassVar[str] = "cpu"
    block_dim: ClassVar[int] = 1
    # the decode paths read whole blocks and mask scores past each sequence's end
    # (no masked_fill of K/V per layer), so fresh memory must hold finite values
    needs_zeroed_blocks: ClassVar[bool] = True
    # 8-bit caches: the native 8-bit decode kernel (attention/quantized.py)
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = (
        "auto", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device, dtype)
        self._k_pool: torch.Tensor | None = None

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"it runs on a CPU, not on {device.type}"
        return None

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def bind_pool(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # the plan's gather indices depend on the pool's block count and head count
        self._k_pool = kv_caches[0][0] if kv_caches else None

    def plan(self, meta: AttentionMetadata) -> _Plan | _DecodePlan | None:
        if self._k_pool is None:  # no pool bound: the first layer plans instead
            return None
        return plan_step(meta, self._k_pool)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)

    # the function itself, not a method wrapping it: no extra frame per layer and step
    forward = staticmethod(paged_attention_fast)
