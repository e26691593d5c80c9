"""The fast attention path for a paged KV cache, in plain torch.

Same contract as `paged_attention_reference`, fewer and cheaper ops:
- decode rows (one query each) of all sequences go through three batched ops
  (scores, softmax, weighted sum), with grouped-query heads handled by a
  reshape instead of repeating K/V per query head, and no flash-attention
  kernel (whose fixed cost dominates a single query);
- a prefill chunk with no cached prefix attends to this step's own K/V, not a
  copy gathered back out of the cache;
- a sequence whose blocks are consecutive reads its K/V as a view of the pool,
  so only fragmented block tables pay for a gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.models.context import AttentionMetadata


def _seq_kv(cache: torch.Tensor, table: list[int], seq_len: int) -> torch.Tensor:
    """(seq_len, kv_heads, head_dim) of one sequence: a view when its blocks are consecutive."""
    block_size = cache.shape[1]
    n = -(-seq_len // block_size)
    first = table[0]
    if table[n - 1] - first == n - 1 and all(b == first + i for i, b in enumerate(table[:n])):
        return cache[first:first + n].flatten(0, 1)[:seq_len]
    idx = torch.tensor(table[:n], dtype=torch.int64, device=cache.device)
    return cache.index_select(0, idx).flatten(0, 1)[:seq_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            causal_offset: int | None) -> torch.Tensor:
    """q (Q, heads, d); k, v (L, kv_heads, d). causal_offset: query i sees keys
    0..offset+i (None: all keys). Returns (Q, heads, d)."""
    num_q, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    if num_q == 1:  # fp32: small bf16 matmuls are slower on CPU than fp32 ones
        qg = q.view(kv_heads, group, d).float()  # (kv, g, d)
        kt = k.transpose(0, 1).float().contiguous()  # (kv, L, d): a plain bmm operand
        probs = torch.softmax(torch.bmm(qg, kt.transpose(1, 2)).mul_(scale), dim=-1)
        vt = v.transpose(0, 1).float().contiguous()
        return torch.bmm(probs, vt).view(1, heads, d).to(q.dtype)
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
    if causal_offset is None or causal_offset == 0 and num_q == k.shape[0]:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal_offset is not None,
                                             scale=scale)
    else:
        q_pos = torch.arange(causal_offset, causal_offset + num_q, device=q.device)
        mask = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  tables: torch.Tensor, seq_lens: list[int], scale: float) -> torch.Tensor:
    """One query per sequence, all sequences at once. q (B, heads, d) -> (B, heads, d).

    K and V are gathered into contiguous (B * kv_heads, S, d) operands so both
    products are plain 3-D bmm calls: a 4-D matmul over permuted views made
    torch copy and fold them on every call, 7x slower at 16 x 1,100 tokens.
    Scores and softmax are fp32; the weighted sum runs in the cache dtype.
    Needs finite values in slots past each sequence's end (see ModelRunner).
    """
    num_seqs, heads, d = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    max_len = max(seq_lens)
    n_blocks = -(-max_len // block_size)
    span = n_blocks * block_size
    idx = tables[:, :n_blocks].reshape(-1).long()

    def gather(cache: torch.Tensor) -> torch.Tensor:  # (B, kv, S, d), contiguous
        return cache.index_select(0, idx).view(num_seqs, span, kv_heads, d).transpose(1, 2) \
            .contiguous()

    k = gather(k_cache).view(num_seqs * kv_heads, span, d).float()
    v = gather(v_cache)
    lens = torch.tensor(seq_lens, device=q.device)
    # slots past a sequence's end hold zeros or stale finite K/V (the model runner
    # zeroes each block on first use), so masking their scores is enough
    pad = torch.arange(span, device=q.device)[None, :] >= lens[:, None]  # (B, S)
    qg = q.reshape(num_seqs * kv_heads, group, d).float()
    scores = torch.bmm(qg, k.transpose(1, 2))  # (B * kv, g, S)
    scores = scores.view(num_seqs, kv_heads, group, span)
    scores.mul_(scale).masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(num_seqs * kv_heads, group, span)
    out = torch.bmm(probs, v.view(num_seqs * kv_heads, span, d))  # (B * kv, g, d)
    return out.view(num_seqs, heads, d).to(q.dtype)


def paged_attention_fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q (T, heads, d); k, v (T, kv_heads, d) this step's keys/values (already stored
    in the caches). Returns (T, heads, d)."""
    query_lens, seq_lens = meta.query_lens_list, meta.seq_lens_list
    if meta.is_decode_only and len(seq_lens) > 1:
        return _decode_batch(q, k_cache, v_cache, meta.block_tables, seq_lens, scale)
    plan = meta.derived.get("fast_attention")
    if plan is None:  # the same for every layer of the step: derive it once
        plan = meta.derived["fast_attention"] = _Plan(meta, q.device)
    out = torch.empty_like(q)
    start = 0
    for b, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        end = start + query_len
        if b in plan.batched_decodes:
            pass
        elif query_len == seq_len:  # a whole prompt: its K/V are this step's
            out[start:end] = _attend(q[start:end], k[start:end], v[start:end], scale, 0)
        else:
            ks = _seq_kv(k_cache, plan.tables[b], seq_len)
            vs = _seq_kv(v_cache, plan.tables[b], seq_len)
            out[start:end] = _attend(q[start:end], ks, vs, scale, seq_len - query_len)
        start = end
    if plan.batched_decodes:
        out[plan.decode_rows] = _decode_batch(
            q.index_select(0, plan.decode_rows), k_cache, v_cache, plan.decode_tables,
            plan.decode_seq_lens, scale)
    return out


class _Plan:
    """How a mixed step splits: single-query rows batched together, the rest per sequence."""

    def __init__(self, meta: AttentionMetadata, device: torch.device) -> None:
        self.tables: list[list[int]] = meta.block_tables.tolist()
        lens = meta.query_lens_list
        decodes = [b for b, n in enumerate(lens) if n == 1] if len(lens) > 1 else []
        self.batched_decodes = set(decodes) if len(decodes) > 1 else set()
        if self.batched_decodes:
            starts = meta.query_start_loc.tolist()
            self.decode_rows = torch.tensor([starts[b] for b in decodes], device=device)
            self.decode_tables = meta.block_tables.index_select(
                0, torch.tensor(decodes, device=device))
            self.decode_seq_lens = [meta.seq_lens_list[b] for b in decodes]
