"""The engine: add_request / step / abort.

One step is four public phases, which the synchronous step below and the
overlapped one (engine/core/overlap.py, --async-scheduling) both call:
`admit` (constrained requests whose grammar compiled join the queue),
`schedule` (the scheduler picks sequences and token counts), `run` (the model
runner runs them as one flat batch, the sampler picks next tokens) and
`resolve` (tokens appended, stops checked, outputs built, finished requests
retired). Start-up wiring is engine/core/builder.py; request checks are
engine/core/validation.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from tokenmill.config import EngineConfig
from tokenmill.engine.core.append import Emitted, append_tokens
from tokenmill.engine.core.builder import build_engine_parts
from tokenmill.engine.core.lora_manager import resolve_lora, run_under
from tokenmill.engine.core.outputs import RequestOutput
from tokenmill.engine.core.overlap import OverlapStepper
from tokenmill.engine.core.phase_timer import PhaseTimer
from tokenmill.engine.core.prompt_logprobs import prompt_rows, record_prompt_logprobs
from tokenmill.engine.core.requests import EngineRequest
from tokenmill.engine.core.scheduler import SchedulerOutput
from tokenmill.engine.core.stats import EngineStats
from tokenmill.engine.core.validation import RequestError
from tokenmill.engine.runner.heap_trim import HeapTrimmer
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """detokenize=False: outputs carry token ids only (text ""), `stop` strings are left to
    whoever detokenizes (the core process's front end). precompile_now=False: a server starts
    `precompile` once it answers. Its parts (runner, ...) are builder.EngineParts' fields."""

    def __init__(self, config: EngineConfig | None = None, detokenize: bool = True,
                 precompile_now: bool = True, **kwargs) -> None:
        config = config or EngineConfig(**kwargs)
        self.config = config
        vars(self).update(vars(build_engine_parts(config, detokenize, precompile_now)))
        self.overlap: OverlapStepper | None = None
        if config.async_scheduling:
            if self.speculator is not None:  # drafts need the host's accepted tokens
                logger.warning("--async-scheduling is off with speculative decoding: "
                               "every step runs synchronously")
            else:
                self.overlap = OverlapStepper(self)
        self.heap = HeapTrimmer()  # engine/runner/heap_trim.py: RSS flat under mixed lengths
        self.requests: dict[str, EngineRequest] = {}
        self._compiling: dict[str, EngineRequest] = {}  # constrained requests waiting for a grammar
        self.prompt_logprobs: dict[int, list] = {}  # first sample's seq_id -> logprobs so far
        self.stats = EngineStats(num_total_blocks=self.block_manager.num_total_blocks,
                                 kv_cache_bytes=self.runner.kv_cache_bytes)

    # ---- requests -------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: object = None) -> None:
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running")
        admitted = self.validator.admit(prompt, params or SamplingParams())
        lora_request = resolve_lora(self.lora, lora_request, admitted.params)
        params, ids = admitted.params, admitted.prompt_token_ids
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.submit(params.structured_outputs)
            if grammar.done() and grammar.exception() is not None:
                err = grammar.exception()
                raise RequestError(str(err), getattr(err, "param", "structured_outputs"))
        now = time.monotonic() if arrival_time is None else arrival_time
        share_prompt = params.n > 1 and self.block_manager.enable_prefix_caching
        req = EngineRequest.start(request_id, admitted, now, grammar, share_prompt)
        pulled = self.kv_transfer.hold(req)  # a decode request: its prompt KV is pulled first
        self.requests[request_id] = req
        run_under(req.seqs, lora_request)
        if params.prompt_logprobs is not None:
            self.prompt_logprobs[req.seqs[0].seq_id] = [None]  # the first token has no context
        if grammar is not None and not grammar.done():
            self._compiling[request_id] = req  # scheduled once compiled
        elif not pulled:
            for seq in req.seqs:
                self.scheduler.add(seq)
        self.stats.prompt_tokens += len(ids)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self.requests.pop(rid, None)
            self._compiling.pop(rid, None)
            self.kv_transfer.abort(rid)
            if req is not None:
                req.pending_siblings = 0
                self.prompt_logprobs.pop(req.seqs[0].seq_id, None)
                aborted = self.scheduler.abort(rid)
                if self.speculator is not None:
                    self.speculator.forget(aborted)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self.kv_transfer.busy()  # pins to free: keep stepping

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step -------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of the requests it advanced. Under async
        scheduling (engine/core/overlap.py) the outputs are those of the step before,
        learnt while this one ran."""
        outputs = self.overlap.step() if self.overlap is not None else self._step()
        self.heap.after_step(busy=self.has_unfinished_requests())
        return outputs

    def _step(self) -> list[RequestOutput]:
        timer = PhaseTimer(self.stats.time_s)
        failed = self.admit()
        with timer("schedule"):
            batch = self.schedule()
        if not batch.scheduled:
            return failed
        emitted = self.run(batch)
        with timer("postprocess"):
            outputs = self.resolve(emitted, batch)
        self.end_step()
        return failed + outputs

    def admit(self) -> list[RequestOutput]:
        """Requests whose KV was pulled join running with their first token; constrained
        ones whose grammar compiled are scheduled, those whose grammar did not fail."""
        failed = self.resolve(self.kv_transfer.admit(self.scheduler, self.stats))
        for req in list(self._compiling.values()):
            if req.grammar is None or not req.grammar.done():
                continue
            del self._compiling[req.request_id]
            err = req.grammar.exception()
            if err is None:
                for seq in req.seqs:
                    self.scheduler.add(seq)
                continue
            logger.warning("request %s: %s", req.request_id, err)
            for seq in req.seqs:
                seq.finish("abort")
            req.pending_siblings = 0
            failed.append(self._request_output(req))
            del self.requests[req.request_id]
        return failed

    def schedule(self) -> SchedulerOutput:
        """The next step's batch, its tokens counted in the stats."""
        batch = self.scheduler.schedule()
        if batch.scheduled:
            self.stats.count_step(batch)
        return batch

    def run(self, batch: SchedulerOutput) -> Emitted:
        """Forward and sample one batch, synchronously: per sampling sequence, the
        tokens to append and their logprobs (speculation: accepted drafts + one)."""
        timer = PhaseTimer(self.stats.time_s)
        if self.speculator is not None:  # proposes drafts: widens decoding entries
            self.speculator.extend(batch, self.scheduler.num_running)
        with timer("prepare"):
            ids, pos, meta, rows = self.runner.prepare(batch.scheduled)
            extra = prompt_rows(batch.scheduled, self.prompt_logprobs)
        with timer("forward"):
            logits = self.runner.forward(ids, pos, meta, rows + extra.rows)
        if extra.rows:  # prompt rows come after the sampling rows
            record_prompt_logprobs(logits[len(rows):], extra, self.prompt_logprobs)
            logits = logits[:len(rows)]
        with timer("sample"):
            if self.speculator is not None:
                return self.speculator.verify(batch, logits, self.sampler)
            seqs = [item.seq for item in batch.scheduled if item.sample]
            out = self.sampler(logits, seqs)
        return [(seq, [t], [lp]) for seq, t, lp in zip(seqs, out.token_ids, out.logprobs)]

    def resolve(self, emitted: Emitted, batch: SchedulerOutput | None = None
                ) -> list[RequestOutput]:
        """Append the emitted tokens, check stops, build one output per request
        touched and drop the finished ones. `batch`: the step these tokens end
        (the synchronous step); None when the scheduler already advanced past it
        (the overlapped step), so only what finished is retired."""
        append_tokens(emitted, self.constraints, self.detokenizer, self.stop_checker, self.stats)
        touched = {seq.request_id: self.requests[seq.request_id] for seq, _, _ in emitted
                   if seq.request_id in self.requests}
        if batch is not None:
            if self.speculator is not None:  # rejected drafts' KV slots go back
                self.speculator.rollback(batch)
            self.scheduler.finish_step(batch)
        else:
            finished = [seq for seq, _, _ in emitted if seq.is_finished]
            if finished:
                self.scheduler.retire(finished)
        for req in touched.values():
            if req.pending_siblings:  # the first sample's prompt is cached: they share it
                for seq in req.add_siblings():
                    self.scheduler.add(seq)
        outputs = [self._request_output(req) for req in touched.values()]
        for out in outputs:
            if out.finished:
                req = self.requests.pop(out.request_id)
                self.prompt_logprobs.pop(req.seqs[0].seq_id, None)
        return outputs

    def end_step(self) -> None:
        """After a step's books changed: KV events out; the books checked (debug)."""
        if self.kv_events is not None:
            self.kv_events.publish()
        if self.config.debug_kv_integrity:
            self.check_kv_integrity()

    def check_kv_integrity(self) -> None:
        """Raise KVCacheIntegrityError unless the KV books (ref counts, free list,
        prefix-cache hashes, live block tables) agree, the draft model's too.
        Run after every step under --debug-kv-integrity, and by the tests."""
        live = [*self.scheduler.waiting, *self.scheduler.running, *self.kv_transfer.holders()]
        self.block_manager.check_integrity(live)
        proposer = self.speculator.proposer if self.speculator is not None else None
        draft_bm = getattr(proposer, "block_manager", None)
        if draft_bm is not None:  # --speculative draft: its own cache and shadow sequences
            draft_bm.check_integrity(list(proposer.shadows.values()))

    def _request_output(self, req: EngineRequest) -> RequestOutput:
        return req.output(self.prompt_logprobs.get(req.seqs[0].seq_id))

    def close(self) -> None:
        """Release what outlives a step (the KV-event sockets, the tensor-parallel
        workers, the KV-transfer sockets); idempotent."""
        self.kv_transfer.close()
        if getattr(self, "kv_events", None) is not None:
            self.kv_events.close()
            self.kv_events = None
        if getattr(self, "overlap", None) is not None:
            self.overlap.close()
        if getattr(self, "workers", None) is not None:
            self.workers.close()
            self.workers = None

    def parallel_failure(self) -> str | None:
        """Why the tensor-parallel group is broken (a local worker exited), or None."""
        return None if self.workers is None else self.workers.dead_worker()

    def get_stats(self) -> EngineStats:
        return self.stats.refresh(self.scheduler, self.block_manager, self.speculator, self.runner)
