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
from torch import nn

from tokenmill.attention.cpu import paged_attention_fast
from tokenmill.attention.metadata import get_attention_metadata
from tokenmill.attention.torch_ref import (
    causal_attention,
    paged_attention_reference,
    store_kv_torch,
)
from tokenmill.kernels import paged_decode as native

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
    store_kv_torch(k, v, k_cache, v_cache, slot_mapping)
