"""Turns a schedule into tensors, owns the paged KV cache, runs the model.

The only engine file that builds tensors: the scheduler decides who runs and
how many tokens each gets; this file lays those tokens out as one flat batch
with its attention metadata, runs `model.forward`, and returns the logits of
the sequences that sample this step.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from tokenmill.attention.metadata import AttentionMetadata, attention_metadata
from tokenmill.config import ModelConfig
from tokenmill.engine.sequence import Sequence
from tokenmill.models.attention import kv_cache_shape


class Scheduled(Protocol):
    seq: Sequence
    num_new_tokens: int
    sample: bool
    num_draft_tokens: int


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, block_size: int,
                 num_blocks: int, kv_dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        shape = kv_cache_shape(num_blocks, block_size, config.num_key_value_heads,
                               config.head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in model.attention_layers():
            # empty, not zeros: pages are touched only as blocks fill, so RSS tracks use
            k = torch.empty(shape, dtype=kv_dtype, device=device)
            v = torch.empty(shape, dtype=kv_dtype, device=device)
            layer.k_cache, layer.v_cache = k, v
            self.kv_caches.append((k, v))
        # Attention reads whole blocks and masks the slots past a sequence's end; a
        # zero weight on a NaN left in fresh memory is still NaN, so each block is
        # zeroed the first time a step uses it (block 0 now: it pads block tables).
        self._fresh = bytearray(b"\x01") * num_blocks
        self._zero_blocks([0])

    def _zero_blocks(self, block_ids: list[int]) -> None:
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for k, v in self.kv_caches:
            k.index_fill_(1, idx, 0)
            v.index_fill_(1, idx, 0)
        for b in block_ids:
            self._fresh[b] = 0

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv_caches)

    def prepare(self, batch: Seq[Scheduled]) -> tuple[torch.Tensor, torch.Tensor,
                                                      AttentionMetadata, list[int]]:
        """Flat input ids, positions, attention metadata, and the row of each
        sampling sequence's last token in the flat batch (and of the token
        before each of its draft tokens)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logit_rows: list[int] = []
        fresh: list[int] = []
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            fresh.extend(b for b in table[start // bs:(end - 1) // bs + 1] if self._fresh[b])
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            query_lens.append(n)
            if item.sample:
                logit_rows.extend(range(query_start[-1] - 1 - item.num_draft_tokens,
                                        query_start[-1]))
        if fresh:
            self._zero_blocks(fresh)
        max_blocks = max((len(item.seq.block_table) for item in batch), default=0)
        tables = [item.seq.block_table + [0] * (max_blocks - len(item.seq.block_table))
                  for item in batch]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            block_size=bs,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, logit_rows

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                logit_rows: list[int]) -> torch.Tensor:
        """Logits (len(logit_rows), vocab) float32."""
        with attention_metadata(meta):
            hidden = self.model(ids, pos)  # (T, hidden)
        if not logit_rows:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, rows))
