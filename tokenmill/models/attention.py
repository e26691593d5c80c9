"""Attention over a flat batch of tokens, with or without a paged KV cache.

Without attention metadata (`get_attention_metadata() is None`) the input is one
causal sequence and nothing is cached. With metadata, each layer hands this
step's K and V to its attention backend (tokenmill/attention), which stores
them in the layer's paged cache at `slot_mapping` and attends each sequence's
queries to that sequence's cached prefix plus its new tokens. The layer never
looks at the device: the model runner chose the backend once at start-up.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.metadata import get_attention_metadata
from tokenmill.attention.torch_ref import causal_attention


class Attention(nn.Module):
    """Multi-head attention core (no projections). The KV pool
    (tokenmill/kvcache/pool.py) assigns `backend`, `k_cache` and `v_cache`, the
    caches in the backend's layout."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        # a local layer (Gemma 3, Mistral): query q sees key k iff 0 <= q - k < window
        self.sliding_window = sliding_window
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend: AttentionBackend | None = None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def rotate_and_store(self, positions: torch.Tensor, qk: torch.Tensor, v: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """qk (T, num_heads + num_kv_heads, head_dim) rotated in place with the fp32
        tables cos, sin (RotaryEmbedding's) and its keys and v stored in this layer's
        cache, in one kernel where the backend has one; then `forward(..., stored=True)`.
        False (nothing touched): rotate, then `forward`."""
        meta = get_attention_metadata()
        if meta is None or self.backend is None or self.k_cache is None or self.v_cache is None:
            return False
        return self.backend.rotate_and_store(qk, v, self.num_heads, positions, cos, sin,
                                             self.k_cache, self.v_cache, meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                stored: bool = False) -> torch.Tensor:
        # q: (T, num_heads, head_dim); k, v: (T, num_kv_heads, head_dim) -> (T, num_heads * head_dim)
        # stored: k and v are in the cache already (rotate_and_store)
        meta = get_attention_metadata()
        window = self.sliding_window
        if meta is None:
            return causal_attention(q, k, v, self.scale, window).flatten(1)
        backend = self.backend
        if backend is None or self.k_cache is None or self.v_cache is None:
            raise RuntimeError("attention metadata is set but this layer has no KV cache; "
                               "the model runner must attach a KV pool (backend, k_cache, "
                               "v_cache)")
        if not stored:
            backend.store_kv(k, v, self.k_cache, self.v_cache, meta)
        if window is not None and meta.max_seq_len > window:
            # only when some key can fall outside the window: below it every backend's
            # unwindowed kernels are exact (and keep their speed)
            return backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale,
                                   sliding_window=window).flatten(1)
        return backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale).flatten(1)
