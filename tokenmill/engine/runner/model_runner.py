"""Turns a schedule into tensors, owns the KV pool and the attention backend,
runs the model.

The only engine file that builds tensors: the scheduler decides who runs and
how many tokens each gets; this file lays those tokens out as one flat batch
with its attention metadata (and the backend's plan for it, built once per
step), runs `model.forward`, and returns the logits of the sequences that
sample this step. The attention backend is chosen once, here, at start-up.

Under tensor parallelism rank 0 lays the step out (`layout`: plain lists) and
broadcasts it (`driver`, tokenmill/engine/executor/worker_group.py) as it runs it;
every worker rank stages and uploads the same ints (`run_step`) and runs the same
forward on its shard of the model.

Decode-only steps go through `DecodeGraphs` (engine/cuda_graph.py) when the
backend can run a padded batch: static buffers, one bucket per batch size, a
CUDA graph per bucket on CUDA (unless enforce_eager), the same closure run
eagerly elsewhere. Prefill and mixed steps always run eagerly.

`prepare` is two halves: `stage` writes the step's ints on the host into a
double-buffered staging buffer (engine/staging.py) and touches no device tensor;
`upload` copies them to the device in one copy and builds the metadata. Async
scheduling (engine/overlap.py) stages step N+1 on a helper thread while step N
runs, and `upload` then fills the input ids of tokens still on the device from
the previous step's sampled ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from tokenmill.attention import get_backend, kv_quant
from tokenmill.attention.metadata import AttentionMetadata, attention_metadata
from tokenmill.attention.quantized import QuantizedKVBackend, check_kv_cache_dtype
from tokenmill.config import ModelConfig
from tokenmill.distributed.errors import TensorParallelError
from tokenmill.engine.runner.cuda_graph import DecodeGraphs
from tokenmill.engine.runner.fused_decode import FusedDecode
from tokenmill.engine.runner.lora_rows import log_lora_module_path, lora_groups
from tokenmill.engine.runner.staging import HostStaging
from tokenmill.kvcache.pool import KVPool
from tokenmill.models.lora import lora_batch
from tokenmill.sequence import PLACEHOLDER_TOKEN_ID, Sequence


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
    # async scheduling: rows of input_ids (dst) filled on the device from the previous
    # step's sampled ids (src); never under tensor parallelism (rank 0 alone samples)
    placeholder_dst: list[int] = field(default_factory=list)
    placeholder_src: list[int] = field(default_factory=list)
    # each sequence's LoRA adapter id (0: the base); empty when no sequence has one
    lora_ids: list[int] = field(default_factory=list)


@dataclass
class StagedBatch:
    """A step's ints in a staging buffer (ModelRunner.stage), not yet on the device."""

    host: torch.Tensor  # int64 view of a HostStaging buffer
    num_tokens: int
    width: int  # block-table columns (eager layout)
    query_lens: list[int]
    seq_lens: list[int]
    logit_rows: list[int]
    fresh: list[int]  # never-used blocks to zero before the step writes them
    graphed: bool  # DecodeGraphs' layout, for its static buffers
    num_placeholders: int  # input ids that come from the previous step's samples
    inputs: StepInputs  # the same step as plain lists (what tensor parallelism broadcasts)


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
        # double-buffered: async scheduling writes step N+1's ints while step N runs
        # sized for a full decode batch (ids, positions, slots, seq_lens, a block-table
        # row and two placeholder indices per sequence); a larger step grows it once
        max_blocks = -(-max_model_len // block_size)
        self.staging = HostStaging(max(max_num_seqs, 1) * (6 + max_blocks), device)
        self.graphs: DecodeGraphs | None = None
        if (max_num_seqs and not enforce_eager and self.backend.supports_padded_decode
                and self.pool.fresh is None):
            self.graphs = DecodeGraphs(model, self.backend, config.vocab_size, max_num_seqs,
                                       max_model_len, block_size, device)
            if device.type == "cuda" and self.backend.cuda_graph_capturable and capture_graphs:
                self.graphs.capture()
        # batch-1 decode steps in one native call where that gives the module path's
        # results (engine/fused_decode.py); None: every step runs the modules
        self.fused_decode = FusedDecode.build(model, self.backend, self.kv_caches) \
            if self.graphs is None else None
        # rank 0 under tensor parallelism: broadcasts each step (WorkerGroup.send_step)
        self.driver: Any = None
        # this step's LoRA rows per adapter id, for the metadata they were built with
        self._lora: dict[int, torch.Tensor] | None = None
        self._lora_meta: AttentionMetadata | None = None
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
        return self.upload(self.stage(batch))

    def stage(self, batch: Seq[Scheduled],
              placeholder_rows: Mapping[int, int] | None = None) -> StagedBatch:
        """The host half of `prepare`: the step's ints, written into a staging
        buffer. Touches no device tensor, so async scheduling runs it while the
        previous step computes. `placeholder_rows`: seq_id -> the row, in the
        previous step's sampled ids, of the token that sequence is still waiting
        for (its last token id is PLACEHOLDER_TOKEN_ID)."""
        return self.stage_inputs(self.layout(batch, placeholder_rows))

    def layout(self, batch: Seq[Scheduled],
               placeholder_rows: Mapping[int, int] | None = None) -> StepInputs:
        """The step as plain lists (no tensors). The never-used blocks it writes are
        claimed here (no longer fresh) and zeroed by `upload` before the step runs."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logit_rows: list[int] = []
        fresh: list[int] = []
        dst: list[int] = []  # rows of input_ids that the previous step's samples fill
        src: list[int] = []
        is_fresh = self.pool.fresh  # None: the backend needs no zeroed blocks
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            if end == len(seq.token_ids) and seq.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                if placeholder_rows is None or seq.seq_id not in placeholder_rows:
                    raise RuntimeError(f"{seq!r} waits for a sampled token no step provides")
                dst.append(len(input_ids) + n - 1)
                src.append(placeholder_rows[seq.seq_id])
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if is_fresh is not None:
                for b in table[start // bs:(end - 1) // bs + 1]:
                    if is_fresh[b]:  # claimed now, zeroed by `upload` before the step runs
                        is_fresh[b] = 0
                        fresh.append(b)
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            query_lens.append(n)
            if item.sample:
                logit_rows.extend(range(query_start[-1] - 1 - item.num_draft_tokens,
                                        query_start[-1]))
        lora_ids = [item.seq.lora_int_id for item in batch]
        return StepInputs(input_ids, positions, slots, query_start, seq_lens, query_lens,
                          [item.seq.block_table for item in batch], fresh, logit_rows,
                          placeholder_dst=dst, placeholder_src=src,
                          lora_ids=lora_ids if any(lora_ids) else [])

    def stage_inputs(self, inputs: StepInputs) -> StagedBatch:
        """A laid-out step's ints, written into a staging buffer."""
        input_ids, seq_lens, logit_rows = inputs.input_ids, inputs.seq_lens, inputs.logit_rows
        tables_of = inputs.block_tables
        num_seqs = len(seq_lens)
        dst, src = inputs.placeholder_dst, inputs.placeholder_src
        graphed = (self.graphs is not None and not inputs.lora_ids
                   and len(input_ids) == num_seqs == len(logit_rows)
                   and self.graphs.bucket_for(num_seqs) is not None)
        if graphed:  # decode only: every sequence runs and samples one token
            assert self.graphs is not None
            flat = self.graphs.stage_rows(input_ids, inputs.positions, inputs.slots, seq_lens,
                                          tables_of)
            width = 0
        else:
            width = max((len(t) for t in tables_of), default=0)
            tables = [x for t in tables_of for x in (*t, *[0] * (width - len(t)))]
            flat = [*input_ids, *inputs.positions, *inputs.slots, *inputs.query_start,
                    *seq_lens, *tables]
        host = self.staging.write([*flat, *dst, *src])
        return StagedBatch(host, len(input_ids), width, inputs.query_lens, seq_lens,
                           logit_rows, inputs.fresh_blocks, graphed, len(dst), inputs)

    def upload(self, staged: StagedBatch, previous: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The device half of `prepare`, on the thread that runs the model: one copy of
        the staged ints to the device; placeholder ids gathered from `previous`,
        the previous step's sampled ids (N,) on the device, with no host round trip."""
        if staged.fresh:
            self.pool.zero_blocks(staged.fresh)
        dev = self.staging.upload(staged.host)
        p = staged.num_placeholders
        patch = None
        if p:
            if previous is None:
                raise RuntimeError("a staged batch waits for sampled tokens but no "
                                   "previous step's samples were given")
            dst, src = dev[-2 * p:-p], dev[-p:]
            patch = dst, previous.index_select(0, src)
        t, n, bs = staged.num_tokens, len(staged.seq_lens), self.block_size
        if staged.graphed:
            assert self.graphs is not None
            meta = self.graphs.fill(dev, n, staged.seq_lens)
            self._record(meta, staged)
            b = meta.num_seqs
            if patch is not None:
                self.graphs.input_ids.index_copy_(0, *patch)
            # the padded bucket's ids and positions, so that a caller running the model
            # itself over this metadata (speculative/layerskip.py) sees matching shapes
            return self.graphs.input_ids[:b], self.graphs.positions[:b], meta, \
                staged.logit_rows
        ids, pos, slots = dev[:t], dev[t:2 * t], dev[2 * t:3 * t]
        o = 3 * t
        # query starts, sequence lengths and block tables as int32, in one conversion
        ints = dev[o:o + 2 * n + 1 + n * staged.width].to(torch.int32)
        if patch is not None:
            ids.index_copy_(0, *patch)
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=ints[:n + 1],
            seq_lens=ints[n + 1:2 * n + 1],
            block_tables=ints[2 * n + 1:].view(n, staged.width),
            block_size=bs,
            max_query_len=max(staged.query_lens, default=0),
            max_seq_len=max(staged.seq_lens, default=0),
            query_lens_list=staged.query_lens,
            seq_lens_list=staged.seq_lens,
        )
        fused = self.fused_decode
        self._lora = lora_groups(staged.inputs, dev.device) if staged.inputs.lora_ids else None
        fused_takes = fused is not None and fused.takes(staged.query_lens, staged.logit_rows)
        if self._lora is not None:
            self._lora_meta = meta
        if not fused_takes:
            meta.plan = self.backend.plan(meta)  # once per step, shared by every layer
        # else the fused step needs none (should it refuse the step, the first layer plans)
        self._record(meta, staged)
        return ids, pos, meta, staged.logit_rows

    def _record(self, meta: AttentionMetadata, staged: StagedBatch) -> None:
        if self.driver is not None:  # rank 0: `forward` broadcasts this step
            if staged.num_placeholders:
                raise RuntimeError("async scheduling cannot run under tensor parallelism")
            self._last_step = (meta, staged.inputs)

    def run_step(self, inputs: StepInputs) -> None:
        """A tensor-parallel worker's step: rank 0's layout, this rank's shard."""
        ids, pos, meta, _ = self.upload(self.stage_inputs(inputs))
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
        # adapters: the fused step adds each one's products after every linear, or the
        # module path's LoRALinear does
        groups = self._lora if self._lora_meta is meta else None
        fused = self.fused_decode
        if fused is not None and fused.takes(meta.query_lens_list, logit_rows):
            result = fused.run(ids, pos, meta, groups)
            if result is not None:
                logits, hidden = result
                return logits if logits is not None else self.model.compute_logits(hidden)
            if groups is not None:
                log_lora_module_path()
        with attention_metadata(meta), lora_batch(groups):
            hidden = self.model(ids, pos)  # (T, hidden)
        return self._logits(hidden, logit_rows)

    def _logits(self, hidden: torch.Tensor, logit_rows: list[int]) -> torch.Tensor:
        if not logit_rows:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, rows))
