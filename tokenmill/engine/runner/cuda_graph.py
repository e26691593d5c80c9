"""Decode steps as one replayable call over static buffers, one per batch bucket.

nano-vllm's `capture_cudagraph`: a decode step (one query per sequence) is a
closure that reads only buffers allocated once for `max_num_seqs` rows; the
batch is padded to its bucket (1, 2, 4, 8, then steps of 8), its inputs are
`copy_`'d in, and the bucket's CUDA graph is replayed. Padded rows get slot -1
(the KV store skips it) and seq_len 0 (attention reads no key for them), and
their logits are never read. On a CPU, or under --enforce-eager, the same
closure runs eagerly over the same buffers, so a padding or stale-buffer bug
shows up in CPU tests.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import torch

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.metadata import AttentionMetadata, attention_metadata

logger = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8, the last one max_num_seqs."""
    steps = [1, 2, 4, *range(8, max_num_seqs, 8)]
    return [b for b in steps if b < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    """Static decode buffers, a metadata object and plan per bucket, and (when
    `capture` is on, CUDA only) one CUDA graph per bucket."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, vocab_size: int,
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.buckets = bucket_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        m = max_num_seqs
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(m, dtype=torch.int64, device=device)
        self.positions = torch.zeros(m, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((m,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(m, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(m, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int32, device=device)
        self.logits = torch.zeros(m, vocab_size, dtype=torch.float32, device=device)
        self.metas = {b: self._meta(b, block_size) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _meta(self, b: int, block_size: int) -> AttentionMetadata:
        # host ints are upper bounds a captured graph can bake in: every row could
        # be max_model_len long (the triton plan sizes its split-K from this)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b],
            block_size=block_size, max_query_len=1, max_seq_len=self.max_model_len,
            query_lens_list=[1] * b, seq_lens_list=[self.max_model_len] * b)
        meta.plan = self.backend.plan(meta)  # built once; reads the static views
        return meta

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def fill(self, staged: torch.Tensor, n: int, seq_lens: Seq[int]) -> AttentionMetadata:
        """Copy one staged decode batch (`stage_rows`' layout: its bucket's ids, positions,
        slots, seq_lens, then block-table rows, padding included, already on the
        device) into the static buffers; the bucket's metadata."""
        b = self.bucket_for(n)
        assert b is not None, (n, self.buckets)
        width = self.block_tables.shape[1]
        self.input_ids[:b].copy_(staged[:b])
        self.positions[:b].copy_(staged[b:2 * b])
        self.slot_mapping[:b].copy_(staged[2 * b:3 * b])
        self.seq_lens[:b].copy_(staged[3 * b:4 * b])
        self.block_tables[:b].copy_(staged[4 * b:4 * b + b * width].view(b, width))
        meta = self.metas[b]
        if b not in self.graphs:
            # eager: host-side bounds may follow this step (nothing bakes them in); the
            # windowed paths (attention/window.py) read each row's length from the list
            # (padded rows: one key, their output unread)
            meta.max_seq_len = max(seq_lens)
            meta.seq_lens_list = [*seq_lens, *[1] * (b - n)]
        return meta

    def stage_rows(self, input_ids: Seq[int], positions: Seq[int], slots: Seq[int],
                   seq_lens: Seq[int], tables: Seq[Seq[int]]) -> list[int]:
        """One decode batch as the flat int list `fill` reads, padded to its bucket
        (padded rows: slot -1, seq_len 0)."""
        n = len(input_ids)
        b = self.bucket_for(n)
        assert b is not None, (n, self.buckets)
        width = self.block_tables.shape[1]
        pad = b - n
        rows = [x for t in tables for x in (*t, *[0] * (width - len(t)))]
        return [*input_ids, *[0] * pad, *positions, *[0] * pad, *slots, *[-1] * pad,
                *seq_lens, *[0] * pad, *rows, *[0] * (pad * width)]

    def run(self, meta: AttentionMetadata) -> torch.Tensor:
        """Logits (bucket, vocab) of the batch `load` put in; rows past it are padding."""
        b = meta.num_seqs
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
        else:
            self._step(b)
        return self.logits[:b]

    def _step(self, b: int) -> None:
        """The captured closure: reads and writes only the static buffers."""
        with attention_metadata(self.metas[b]):
            hidden = self.model(self.input_ids[:b], self.positions[:b])  # (b, hidden)
        self.logits[:b].copy_(self.model.compute_logits(hidden))

    @torch.inference_mode()
    def capture(self) -> None:
        """One CUDA graph per bucket, the largest first, sharing one memory pool."""
        assert self.device.type == "cuda"
        pool = None
        for b in reversed(self.buckets):
            self.seq_lens[:b].zero_()
            self.slot_mapping[:b].fill_(-1)  # capture writes no KV
            self._step(b)  # warm-up: triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._step(b)
            pool = graph.pool() if pool is None else pool
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch %s)", len(self.graphs),
                    ", ".join(map(str, self.buckets)))
