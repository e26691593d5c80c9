"""Attention metadata for one forward pass, set by the model runner and read by
attention layers, so that `forward` signatures stay (input_ids, positions)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """A flat batch of T tokens from B sequences, in sequence order.

    Sequence b owns query tokens query_start_loc[b]:query_start_loc[b+1]; after
    this step it has seq_lens[b] tokens in the cache (cached prefix + new tokens),
    so its new tokens sit at positions seq_lens[b] - query_len .. seq_lens[b] - 1.
    """

    slot_mapping: torch.Tensor  # (T,) int64: block_id * block_size + offset, where K/V go
    query_start_loc: torch.Tensor  # (B + 1,) int32
    seq_lens: torch.Tensor  # (B,) int32
    block_tables: torch.Tensor  # (B, max_blocks_per_seq) int32, padded with 0
    block_size: int
    max_query_len: int
    max_seq_len: int
    # the same numbers as Python lists: CPU paths loop without device syncs
    query_lens_list: list[int]
    seq_lens_list: list[int]
    # what every layer of this step shares, built once by the attention
    # backend's plan(meta) (AttentionBackend.plan) before the forward pass
    plan: object = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


_current: AttentionMetadata | None = None


def get_attention_metadata() -> AttentionMetadata | None:
    """None means: no KV cache, the whole input is one causal sequence."""
    return _current


@contextlib.contextmanager
def attention_metadata(meta: AttentionMetadata | None) -> Iterator[None]:
    global _current
    prev, _current = _current, meta
    try:
        yield
    finally:
        _current = prev
