"""The attention-backend interface: one object per engine, chosen once at start-up.

A backend owns three things the rest of the engine must not assume:
- the KV-cache layout (`kv_cache_shape`, `block_dim`): the pool allocator asks
  it for the shape of one layer's K (and V) tensor;
- the per-step plan (`plan`): whatever every layer of one step shares (block
  tables as lists, a decode plan, kernel launch parameters) is derived once by
  the model runner's call to `plan(meta)` and stored in `meta.plan`;
- the two per-layer operations: `store_kv` (this step's K/V into the pool at
  `meta.slot_mapping`) and `forward` (attention of this step's queries over
  each sequence's cached prefix plus its new tokens).

Models never branch on the device or the backend: `Attention.forward` calls
`store_kv` and `forward` on whatever backend the runner assigned.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from tokenmill.attention.metadata import AttentionMetadata


class BackendUnavailable(RuntimeError):
    """The chosen backend cannot run here (missing library, wrong device)."""


class AttentionBackend(ABC):
    name: ClassVar[str]
    # the index of the block dimension in kv_cache_shape(...)
    block_dim: ClassVar[int]
    # True: attention reads whole blocks and masks slots past a sequence's end
    # afterwards, so a NaN left in fresh memory would leak into the output; the
    # pool then zeroes each block the first time a step uses it
    needs_zeroed_blocks: ClassVar[bool] = False
    # the --kv-cache-dtype values it reads; 8-bit ones run through
    # attention/quantized.py's QuantizedKVBackend around this backend
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "bfloat16")
    # True: store_kv skips slot -1 and forward gives seq_len-0 rows no keys, so a
    # decode batch padded to a CUDA-graph bucket is harmless (engine/cuda_graph.py)
    supports_padded_decode: ClassVar[bool] = False
    # True: a decode step reads only tensors (no host sync, no per-step host ints
    # in kernel launches once the plan is built), so it can be captured in a CUDA graph
    cuda_graph_capturable: ClassVar[bool] = False

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype  # the KV cache's dtype

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """None when this backend can run on `device`; else why not (one line)."""
        return None

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's K pool (V has the same)."""

    def bind_pool(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Called once by the KV pool (tokenmill/kvcache/pool.py) after it allocated
        every layer's (K, V) in this backend's layout; a backend whose plan
        depends on the pool (its geometry, its base addresses) keeps what it needs."""

    def plan(self, meta: AttentionMetadata) -> object | None:
        """Called once per step by the model runner before the forward pass; the
        result is stored in `meta.plan` and read by every layer."""
        return None

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """k, v: (T, num_kv_heads, head_dim) -> the caches at meta.slot_mapping (T,)."""

    def rotate_and_store(self, qk: torch.Tensor, v: torch.Tensor, num_heads: int,
                         positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata) -> bool:
        """qk (T, num_heads + num_kv_heads, head_dim): rotate its query and key heads in
        place (RotaryEmbedding's fp32 tables cos, sin at `positions`) and store the keys
        and v into the caches, as rotate then `store_kv` would, in one kernel where the
        backend has one (triton); False (nothing touched): the caller does both."""
        return False

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None) -> torch.Tensor:
        """q: (T, num_heads, head_dim); k, v: this step's (T, num_kv_heads, head_dim),
        already in the caches. Returns (T, num_heads, head_dim). sliding_window: a
        local layer's W, query q seeing key k iff 0 <= q - k < W (None: all keys up
        to q); layers pass it only in steps where some sequence is longer than W."""
