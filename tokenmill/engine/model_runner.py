"""Turns a schedule into tensors, owns the KV pool and the attention backend,
runs the model.

The only engine file that builds tensors: the scheduler decides who runs and
how many tokens each gets; this file lays those tokens out as one flat batch
with its attention metadata (and the backend's plan for it, built once per
step), runs `model.forward`, and returns the logits of the sequences that
sample this step. The attention backend is chosen once, here, at start-up.

Decode-only steps go through `DecodeGraphs` (engine/cuda_graph.py) when the
backend can run a padded batch: static buffers, one bucket per batch size, a
CUDA graph per bucket on CUDA (unless enforce_eager), the same closure run
eagerly elsewhere. Prefill and mixed steps always run eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from tokenmill.attention import get_backend, kv_quant
from tokenmill.attention.metadata import AttentionMetadata, attention_metadata
from tokenmill.attention.quantized import QuantizedKVBackend, check_kv_cache_dtype
from tokenmill.config import ModelConfig
from tokenmill.engine.cuda_graph import DecodeGraphs
from tokenmill.engine.sequence import Sequence
from tokenmill.kvcache.pool import KVPool


class Scheduled(Protocol):
    seq: Sequence
    num_new_tokens: int
    sample: bool
    num_draft_tokens: int


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, block_size: int,
                 num_blocks: int, kv_dtype: torch.dtype, device: torch.device,
                 attention_backend: str = "auto", kv_cache_dtype: str = "auto", *,
                 max_num_seqs: int = 0, max_model_len: int = 0,
                 enforce_eager: bool = False) -> None:
        """max_num_seqs, max_model_len: size the static decode buffers (0: none, every
        step eager); enforce_eager: no CUDA graphs (and, on a CPU, no static-buffer
        path either: every step runs as built)."""
        self.model = model
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        # raises BackendUnavailable, listing the available ones, before any allocation
        self.backend = get_backend(attention_backend, device, kv_dtype)
        kv_format = kv_quant.kv_format(kv_cache_dtype)
        if kv_format is not None:  # an 8-bit cache: the chosen backend, reading bytes + scales
            check_kv_cache_dtype(self.backend.name, kv_cache_dtype)
            self.backend = QuantizedKVBackend(self.backend, kv_format)
        layers = list(model.attention_layers())
        self.pool = KVPool(self.backend, len(layers), num_blocks, block_size,
                           config.num_key_value_heads, config.head_dim, kv_dtype, device,
                           kv_format=kv_format)
        self.pool.attach(layers)
        self.kv_caches = self.pool.kv_caches
        self.graphs: DecodeGraphs | None = None
        if (max_num_seqs and not enforce_eager and self.backend.supports_padded_decode
                and self.pool.fresh is None):
            self.graphs = DecodeGraphs(model, self.backend, config.vocab_size, max_num_seqs,
                                       max_model_len, block_size, device)
            if device.type == "cuda" and self.backend.cuda_graph_capturable:
                self.graphs.capture()

    @property
    def cuda_graphs_captured(self) -> bool:
        return self.graphs is not None and bool(self.graphs.graphs)

    @property
    def kv_cache_bytes(self) -> int:
        return self.pool.nbytes

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
        is_fresh = self.pool.fresh  # None: the backend needs no zeroed blocks
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if is_fresh is not None:
                fresh.extend(b for b in table[start // bs:(end - 1) // bs + 1] if is_fresh[b])
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            query_lens.append(n)
            if item.sample:
                logit_rows.extend(range(query_start[-1] - 1 - item.num_draft_tokens,
                                        query_start[-1]))
        if fresh:
            self.pool.zero_blocks(fresh)
        if (self.graphs is not None and len(input_ids) == len(batch) == len(logit_rows)
                and self.graphs.bucket_for(len(batch)) is not None):
            # decode only: every sequence runs and samples one token
            meta = self.graphs.load(input_ids, positions, slots, seq_lens,
                                    [item.seq.block_table for item in batch])
            # the padded bucket's ids and positions, so that a caller running the model
            # itself over this metadata (speculative/layerskip.py) sees matching shapes
            b = meta.num_seqs
            return self.graphs.input_ids[:b], self.graphs.positions[:b], meta, logit_rows
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
        meta.plan = self.backend.plan(meta)  # once per step, shared by every layer
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, logit_rows

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                logit_rows: list[int]) -> torch.Tensor:
        """Logits (len(logit_rows), vocab) float32."""
        if self.graphs is not None and self.graphs.metas.get(meta.num_seqs) is meta:
            return self.graphs.run(meta)[:len(logit_rows)]
        with attention_metadata(meta):
            hidden = self.model(ids, pos)  # (T, hidden)
        if not logit_rows:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, rows))
