"""Attention over a flat batch of tokens, with or without a paged KV cache.

Without attention metadata (`get_attention_metadata() is None`) the input is one
causal sequence and nothing is cached. With metadata, each layer writes this
step's K and V into its paged cache at `slot_mapping`, then each sequence's
queries attend to that sequence's cached prefix plus its new tokens.

`paged_attention_reference` is the plain-torch path: simple, correct and
linear in the number of sequences. Faster backends live beside it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import paged_decode as native
from tokenmill.models.attention_fast import paged_attention_fast
from tokenmill.attention.metadata import AttentionMetadata, get_attention_metadata

# "fast" (CPU default) or "reference"; TOKENMILL_ATTENTION=reference forces the plain path
BACKEND = os.environ.get("TOKENMILL_ATTENTION", "fast")


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int]:
    """One layer's K (or V) pool: head-major, so that gathering the blocks of a
    batch of sequences yields (kv_heads, B * span, head_dim), a plain bmm operand
    per head and sequence with no transpose copy."""
    return (num_kv_heads, num_blocks, block_size, head_dim)


class Attention(nn.Module):
    """Multi-head attention core (no projections). The model runner assigns
    `k_cache` and `v_cache`, each of `kv_cache_shape(...)`."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (T, num_heads, head_dim); k, v: (T, num_kv_heads, head_dim) -> (T, num_heads * head_dim)
        meta = get_attention_metadata()
        if meta is None:
            out = causal_attention(q, k, v, self.scale)
        else:
            if self.k_cache is None or self.v_cache is None:
                raise RuntimeError("attention metadata is set but this layer has no KV cache; "
                                   "the model runner must assign k_cache and v_cache")
            store_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            if BACKEND == "reference" or q.device.type != "cpu":
                out = paged_attention_reference(q, self.k_cache, self.v_cache, meta, self.scale)
            else:
                out = paged_attention_fast(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return out.flatten(1)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v (T, num_kv_heads, head_dim) into the slots slot_mapping (T,) of the caches."""
    if native.store_kv(k, v, k_cache, v_cache, slot_mapping):
        return  # bf16: one native call instead of two strided index_copy_
    num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(
        1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(
        1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    # q: (..., num_heads, Q, head_dim); k, v: (..., num_kv_heads, K, head_dim)
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    if q.dim() == 3:  # CPU SDPA runs 3-D inputs 2-3x slower than the same as 4-D
        return F.scaled_dot_product_attention(q[None], k.to(q.dtype)[None], v.to(q.dtype)[None],
                                              attn_mask=mask, is_causal=is_causal,
                                              scale=scale)[0]
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                          is_causal=is_causal, scale=scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """All T tokens form one causal sequence. Returns (T, num_heads, head_dim)."""
    out = _sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale, is_causal=True)
    return out.transpose(0, 1)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, num_heads, head_dim) of the flat batch; caches already hold this step's K/V.
    Returns (T, num_heads, head_dim)."""
    if meta.is_decode_only:
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    block_size = meta.block_size
    num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
    out = torch.empty_like(q)
    start = 0
    for b, (query_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        num_blocks = -(-seq_len // block_size)
        block_ids = meta.block_tables[b, :num_blocks].long()
        k = k_cache[:, block_ids].reshape(num_kv_heads, -1, head_dim)[:, :seq_len]  # (kv, L, d)
        v = v_cache[:, block_ids].reshape(num_kv_heads, -1, head_dim)[:, :seq_len]
        q_b = q[start:start + query_len].transpose(0, 1)  # (heads, q, d)
        if query_len == seq_len:
            o = _sdpa(q_b, k, v, scale, is_causal=True)
        else:
            # query i sits at position seq_len - query_len + i and sees keys up to it
            q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # (q, L)
            o = _sdpa(q_b, k, v, scale, mask=mask)
        out[start:start + query_len] = o.transpose(0, 1)
        start += query_len
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query per sequence: gather every sequence's blocks at once and mask the padding."""
    num_seqs = q.shape[0]
    num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
    max_blocks = -(-meta.max_seq_len // meta.block_size)
    block_ids = meta.block_tables[:, :max_blocks].long()  # (B, max_blocks)
    k = k_cache[:, block_ids].reshape(num_kv_heads, num_seqs, -1, head_dim).transpose(0, 1)
    v = v_cache[:, block_ids].reshape(num_kv_heads, num_seqs, -1, head_dim).transpose(0, 1)
    key_pos = torch.arange(k.shape[2], device=q.device)  # k, v: (B, kv, S, d)
    mask = key_pos[None, :] < meta.seq_lens.to(q.device).long()[:, None]  # (B, S)
    # never-written slots may hold NaN, and a masked NaN score or a zero weight on a
    # NaN value is still NaN
    k = k.masked_fill(~mask[:, None, :, None], 0)
    v = v.masked_fill(~mask[:, None, :, None], 0)
    out = _sdpa(q.unsqueeze(2), k, v, scale, mask=mask[:, None, None, :])  # (B, heads, 1, d)
    return out.squeeze(2)
