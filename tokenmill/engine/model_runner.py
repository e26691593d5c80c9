"""Turns a schedule into tensors, owns the KV pool and the attention backend,
runs the model.

The only engine file that builds tensors: the scheduler decides who runs and
how many tokens each gets; this file lays those tokens out as one flat batch
with its attention metadata (and the backend's plan for it, built once per
step), runs `model.forward`, and returns the logits of the sequences that
sample this step. The attention backend is chosen once, here, at start-up.

Under tensor parallelism rank 0 lays the step out (`layout`: plain lists) and
broadcasts it (`driver`, tokenmill/distributed/worker_group.py) as it runs it;
every worker rank builds the same tensors from it (`build`) and runs the same
forward on its shard of the model (`run_step`).

Decode-only steps go through `DecodeGraphs` (engine/cuda_graph.py) when the
backend can run a padded batch: static buffers, one bucket per batch size, a
CUDA graph per bucket on CUDA (unless enforce_eager), the same closure run
eagerly elsewhere. Prefill and mixed steps always run eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from tokenmill.attention import get_backend, kv_quant
from tokenmill.attention.metadata import AttentionMetadata, attention_metadata
from tokenmill.attention.quantized import QuantizedKVBackend, check_kv_cache_dtype
from tokenmill.config import ModelConfig
from tokenmill.distributed.errors import TensorParallelError
from tokenmill.engine.cuda_graph import DecodeGraphs
from tokenmill.engine.sequence import Sequence
from tokenmill.kvcache.pool import KVPool


class Scheduled(Protocol):
    seq: Sequence
    num_new_tokens: int
    sample: bool
    num_draft_tokens: int


@dataclass
class StepInputs:
    """One step as plain lists: what rank 0 broadcasts to the tensor-parallel workers."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_start: list[int]
    seq_lens: list[int]
    query_lens: list[int]
    block_tables: list[list[int]]
    fresh_blocks: list[int]  # first used this step: zeroed before it runs
    logit_rows: list[int]  # the sampling rows
    # every row whose logits the forward computes (sampling rows + prompt-logprob
    # rows), set when rank 0 runs it
    forward_rows: list[int] | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, block_size: int,
                 num_blocks: int, kv_dtype: torch.dtype, device: torch.device,
                 attention_backend: str = "auto", kv_cache_dtype: str = "auto", *,
                 max_num_seqs: int = 0, max_model_len: int = 0,
                 enforce_eager: bool = False, capture_graphs: bool = True) -> None:
        """max_num_seqs, max_model_len: size the static decode buffers (0: none, every
        step eager); enforce_eager: no CUDA graphs (and, on a CPU, no static-buffer
        path either: every step runs as built); capture_graphs False: the static
        buffers, run eagerly (tensor parallelism: collectives are not captured)."""
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
        # this rank's KV heads (its share under tensor parallelism), as its layers say
        kv_heads = getattr(layers[0], "num_kv_heads", config.num_key_value_heads)
        self.pool = KVPool(self.backend, len(layers), num_blocks, block_size, kv_heads,
                           config.head_dim, kv_dtype, device, kv_format=kv_format)
        self.pool.attach(layers)
        self.kv_caches = self.pool.kv_caches
        self.graphs: DecodeGraphs | None = None
        if (max_num_seqs and not enforce_eager and self.backend.supports_padded_decode
                and self.pool.fresh is None):
            self.graphs = DecodeGraphs(model, self.backend, config.vocab_size, max_num_seqs,
                                       max_model_len, block_size, device)
            if device.type == "cuda" and self.backend.cuda_graph_capturable and capture_graphs:
                self.graphs.capture()
        # rank 0 under tensor parallelism: broadcasts each step (WorkerGroup.send_step)
        self.driver: Any = None
        self._last_step: tuple[AttentionMetadata, StepInputs] | None = None

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
        inputs = self.layout(batch)
        ids, pos, meta, rows = self.build(inputs)
        if self.driver is not None:
            self._last_step = (meta, inputs)
        return ids, pos, meta, rows

    def layout(self, batch: Seq[Scheduled]) -> StepInputs:
        """The step as plain lists (no tensors, no state changed)."""
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
        return StepInputs(input_ids, positions, slots, query_start, seq_lens, query_lens,
                          [item.seq.block_table for item in batch], sorted(set(fresh)),
                          logit_rows)

    def build(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor,
                                                 AttentionMetadata, list[int]]:
        """The step's tensors and metadata (zeroing the blocks it uses first)."""
        if inputs.fresh_blocks:
            self.pool.zero_blocks(inputs.fresh_blocks)
        input_ids, positions, slots = inputs.input_ids, inputs.positions, inputs.slots
        seq_lens, query_lens, logit_rows = inputs.seq_lens, inputs.query_lens, inputs.logit_rows
        num_seqs = len(seq_lens)
        if (self.graphs is not None and len(input_ids) == num_seqs == len(logit_rows)
                and self.graphs.bucket_for(num_seqs) is not None):
            # decode only: every sequence runs and samples one token
            meta = self.graphs.load(input_ids, positions, slots, seq_lens, inputs.block_tables)
            # the padded bucket's ids and positions, so that a caller running the model
            # itself over this metadata (speculative/layerskip.py) sees matching shapes
            b = meta.num_seqs
            return self.graphs.input_ids[:b], self.graphs.positions[:b], meta, logit_rows
        max_blocks = max((len(t) for t in inputs.block_tables), default=0)
        tables = [t + [0] * (max_blocks - len(t)) for t in inputs.block_tables]
        query_start = inputs.query_start
        bs = self.block_size
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

    def run_step(self, inputs: StepInputs) -> None:
        """A tensor-parallel worker's step: rank 0's layout, this rank's shard."""
        ids, pos, meta, _ = self.build(inputs)
        self.forward(ids, pos, meta, inputs.forward_rows or [])

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                logit_rows: list[int]) -> torch.Tensor:
        """Logits (len(logit_rows), vocab) float32."""
        if self.driver is None:
            return self._forward(ids, pos, meta, logit_rows)
        # the workers run this step with us
        if self._last_step is None or self._last_step[0] is not meta:
            raise RuntimeError("under tensor parallelism a step must come from prepare()")
        self.driver.send_step(replace(self._last_step[1], forward_rows=list(logit_rows)))
        try:
            return self._forward(ids, pos, meta, logit_rows)
        except TensorParallelError:
            raise
        except Exception as e:
            # the workers wait in this step's collectives: the next step would pair
            # with them out of order, so no step may run again
            reason = f"rank 0 failed inside a tensor-parallel step ({type(e).__name__}: {e})"
            self.driver.mark_broken(reason)
            raise TensorParallelError(reason) from e

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                 logit_rows: list[int]) -> torch.Tensor:
        if self.graphs is not None and self.graphs.metas.get(meta.num_seqs) is meta:
            return self.graphs.run(meta)[:len(logit_rows)]
        with attention_metadata(meta):
            hidden = self.model(ids, pos)  # (T, hidden)
        if not logit_rows:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, rows))
