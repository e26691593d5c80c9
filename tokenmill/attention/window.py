"""Sliding-window attention over the head-major paged cache (torch and cpu backends).

A local layer's query at position q sees key k iff 0 <= q - k < window. Each
sequence gathers only the blocks that hold a key some query of this step can
see (from max(0, first query - window + 1) to its end), so a long context costs
O(window) per local layer, not O(context). Layers call this only when some
sequence of the step is longer than the window (models/attention.py): below it
the unwindowed kernels are exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.metadata import AttentionMetadata


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(Q, K) bool, True where key k_pos[j] is visible to query q_pos[i]."""
    diff = q_pos[:, None] - k_pos[None, :]
    visible = diff >= 0
    return visible if window is None else visible & (diff < window)


def _sdpa_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q (heads, Q, d); k, v (kv_heads, K, d); mask (Q, K) -> (heads, Q, d)."""
    group = q.shape[0] // k.shape[0]
    if group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    return F.scaled_dot_product_attention(q[None], k.to(q.dtype)[None], v.to(q.dtype)[None],
                                          attn_mask=mask, scale=scale)[0]


def windowed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                              window: int) -> torch.Tensor:
    """All T tokens form one sequence (no cache). q (T, heads, d); k, v (T, kv, d)."""
    pos = torch.arange(q.shape[0], device=q.device)
    out = _sdpa_masked(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                       window_mask(pos, pos, window), scale)
    return out.transpose(0, 1)


def windowed_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             meta: AttentionMetadata, scale: float, window: int
                             ) -> torch.Tensor:
    """q (T, heads, d) of the flat batch; head-major caches (kv, blocks, block_size, d)
    already holding this step's K/V. Returns (T, heads, d)."""
    block_size = meta.block_size
    kv_heads, d = k_cache.shape[0], k_cache.shape[-1]
    out = torch.empty_like(q)
    start = 0
    for b, (query_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        first_q = seq_len - query_len
        first_k = max(0, first_q - window + 1)
        first_block, last_block = first_k // block_size, -(-seq_len // block_size)
        block_ids = meta.block_tables[b, first_block:last_block].long()
        lo, hi = first_k - first_block * block_size, seq_len - first_block * block_size
        k = k_cache[:, block_ids].reshape(kv_heads, -1, d)[:, lo:hi]  # (kv, L, d)
        v = v_cache[:, block_ids].reshape(kv_heads, -1, d)[:, lo:hi]
        q_pos = torch.arange(first_q, seq_len, device=q.device)
        k_pos = torch.arange(first_k, seq_len, device=q.device)
        o = _sdpa_masked(q[start:start + query_len].transpose(0, 1), k, v,
                         window_mask(q_pos, k_pos, window), scale)
        out[start:start + query_len] = o.transpose(0, 1)
        start += query_len
    return out
