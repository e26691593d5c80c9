"""The `torch` attention backend: plain torch over a paged KV cache, simple,
correct and linear in the number of sequences; the reference the faster
backends are tested against, and the one that runs on any device torch runs
on. `causal_attention` also serves the model's no-cache path.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.window import windowed_causal_attention, windowed_paged_attention


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int]:
    """One layer's K (or V) pool, head-major: gathering the blocks of a batch of
    sequences yields (kv_heads, B * span, head_dim), a plain bmm operand per head
    and sequence with no transpose copy. The torch and cpu backends share it."""
    return (num_kv_heads, num_blocks, block_size, head_dim)


class TorchBackend(AttentionBackend):
    name: ClassVar[str] = "torch"
    block_dim: ClassVar[int] = 1
    # the decode path zeroes K/V past each sequence's end itself; prefill
    # gathers exactly seq_len slots
    needs_zeroed_blocks: ClassVar[bool] = False
    # 8-bit caches: dequantized blocks, then this path (attention/quantized.py)
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = (
        "auto", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
    # store_kv drops slot -1 rows (a host sync: fine here, never captured)
    supports_padded_decode: ClassVar[bool] = True

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        store_kv_torch(k, v, k_cache, v_cache, meta.slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None) -> torch.Tensor:
        if sliding_window is not None:
            return windowed_paged_attention(q, k_cache, v_cache, meta, scale, sliding_window)
        return paged_attention_reference(q, k_cache, v_cache, meta, scale)


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v (T, num_kv_heads, head_dim) into the slots slot_mapping (T,) of
    head-major caches (kv_heads, num_blocks, block_size, head_dim); a slot < 0
    is padding and is not stored."""
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
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
                     scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """All T tokens form one causal sequence. Returns (T, num_heads, head_dim)."""
    if sliding_window is not None and q.shape[0] > sliding_window:
        return windowed_causal_attention(q, k, v, scale, sliding_window)
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
