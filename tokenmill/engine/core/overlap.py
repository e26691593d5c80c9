"""Async scheduling (`--async-scheduling`): the host schedules step N+1 while step N
computes (vLLM's async scheduling, SGLang's overlap scheduler).

One `step()` call runs step N's forward and sampling on the calling thread (on
CUDA: queued on the stream; on a CPU: the math itself, which releases the GIL,
and stays on the main thread where libgomp is fast — see async_engine.py) while
one helper thread does the host's work around it:

  1. learn step N-1's tokens (its one device-to-host copy), append them, check
     stops, detokenize, build the outputs; retire what finished;
  2. give each sequence that samples at step N a placeholder token
     (PLACEHOLDER_TOKEN_ID), the id still on the device, so that it has one
     uncomputed token, and advance step N in the scheduler (`finish_step`);
  3. schedule step N+1 and stage its ints (ModelRunner.stage: a double-buffered
     staging buffer whose event guards reuse). A placeholder's input id is
     gathered on the device from step N's sampled ids when N+1 is uploaded.

The call returns step N-1's outputs: tokens reach the caller one step late, and
a sequence that finished at step N-1 (EOS, a stop string) has had one more token
computed at step N, which is discarded; its blocks are freed as soon as its end
is known (freed blocks are only reused by later steps, which run after N). A
sequence that will surely end by length (max_tokens, max_model_len) gets no
placeholder, so it computes nothing extra.

A step runs synchronously — this step's tokens learnt before the next step is
scheduled — when a sampling row needs its previous token on the host to sample
the next: structured output (the grammar's bitmask), bad_words, repetition /
frequency / presence penalties (token counts), and a step that records prompt
logprobs. Speculative decoding turns async scheduling off (llm_engine.py).
`EngineStats.num_async_steps` counts the overlapped steps.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenmill.engine.core.phase_timer import PhaseTimer
from tokenmill.engine.core.prompt_logprobs import (
    PromptRows,
    prompt_rows,
    record_prompt_logprobs,
)
from tokenmill.engine.core.sampler import SampledBatch, SamplingPlan
from tokenmill.engine.core.sampling_ops import has_penalty
from tokenmill.engine.core.scheduler import SchedulerOutput
from tokenmill.engine.runner.model_runner import StagedBatch
from tokenmill.sequence import PLACEHOLDER_TOKEN_ID, Sequence

if TYPE_CHECKING:
    from tokenmill.engine.core.llm_engine import LLMEngine
    from tokenmill.engine.core.outputs import RequestOutput


@dataclass
class _Staged:
    """The next step: scheduled and staged while the step before it ran."""

    batch: SchedulerOutput
    staged: StagedBatch


@dataclass
class _Ran:
    """A step whose sampled ids are on the device; the host has not read them yet."""

    seqs: list[Sequence]  # the sampling rows, in order
    sampled: SampledBatch
    # seq_id -> row in `sampled` of the sequences holding a placeholder for it
    placeholder_rows: dict[int, int] = field(default_factory=dict)


def needs_host_tokens(seq: Sequence) -> bool:
    """Sampling this sequence's next token reads its previous tokens on the host."""
    p = seq.sampling_params
    return bool(p.structured_outputs is not None or p.bad_words_token_ids or p.bad_words
                or has_penalty(p))


class OverlapStepper:
    """`LLMEngine.step()` under --async-scheduling: the engine's public phases
    (admit, schedule, resolve, end_step) around a staged run of its own."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-schedule")
        self._next: _Staged | None = None  # step N+1, when step N ran overlapped
        self._ran: _Ran | None = None  # step N, not yet resolved

    def close(self) -> None:
        self._helper.shutdown(wait=True)

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        timer = PhaseTimer(eng.stats.time_s)
        outputs = eng.admit()
        nxt, self._next = self._next, None
        try:
            if nxt is None:  # nothing staged ahead: schedule now, on this thread
                with timer("schedule"):
                    batch = eng.schedule()
                if batch.scheduled:
                    with timer("prepare"):
                        placeholders = self._ran.placeholder_rows if self._ran else None
                        nxt = _Staged(batch, eng.runner.stage(batch.scheduled, placeholders))
            if nxt is None:  # nothing to run: the last step's tokens, if any, come now
                with timer("postprocess"):
                    outputs += self._resolve_ran()
            else:
                sampling = [item.seq for item in nxt.batch.scheduled if item.sample]
                extra = prompt_rows(nxt.batch.scheduled, eng.prompt_logprobs)
                if extra.rows or any(needs_host_tokens(s) for s in sampling):
                    outputs += self._step_synchronously(nxt, sampling, extra)
                else:
                    outputs += self._step_overlapped(nxt, sampling)
        except BaseException:
            # the caller aborts what was in flight; blocks a dropped staged step
            # claimed as fresh are zeroed here, since its upload never will
            if self._next is not None and self._next.staged.fresh:
                eng.runner.pool.zero_blocks(self._next.staged.fresh)
            self._next = self._ran = None
            raise
        eng.end_step()
        return outputs

    # ---- the two kinds of step ------------------------------------------------------

    def _step_overlapped(self, nxt: _Staged, sampling: list[Sequence]) -> list[RequestOutput]:
        """Run `nxt` here; meanwhile the helper resolves the step before it, then
        schedules and stages the step after it."""
        plan = self.engine.sampler.plan(sampling)  # before the helper changes the sequences
        ran = self._ran
        host = self._helper.submit(self._host_work, ran, nxt.batch, sampling)
        try:
            sampled = self._run(nxt, sampling, plan, PromptRows())
        finally:
            outputs, self._next, placeholder_rows = host.result()
        self._ran = _Ran(sampling, sampled, placeholder_rows)
        self.engine.stats.num_async_steps += 1
        return outputs

    def _step_synchronously(self, nxt: _Staged, sampling: list[Sequence],
                            extra: PromptRows) -> list[RequestOutput]:
        """Run `nxt` and learn its tokens before anything else is scheduled."""
        eng = self.engine
        plan = eng.sampler.plan(sampling)
        sampled = self._run(nxt, sampling, plan, extra)
        with PhaseTimer(eng.stats.time_s)("postprocess"):
            outputs = self._resolve_ran() + self._resolve(_Ran(sampling, sampled))
            eng.scheduler.finish_step(nxt.batch)
        return outputs

    # ---- pieces ---------------------------------------------------------------------

    def _run(self, nxt: _Staged, sampling: list[Sequence], plan: SamplingPlan,
             extra: PromptRows) -> SampledBatch:
        """Upload, forward and sample one step on this thread; no host sync (on CUDA)."""
        eng = self.engine
        timer = PhaseTimer(eng.stats.time_s)
        previous = self._ran.sampled.token_ids if self._ran is not None else None
        with timer("prepare"):
            ids, pos, meta, rows = eng.runner.upload(nxt.staged, previous)
        with timer("forward"):
            logits = eng.runner.forward(ids, pos, meta, rows + extra.rows)
        if extra.rows:  # prompt rows come after the sampling rows
            record_prompt_logprobs(logits[len(rows):], extra, eng.prompt_logprobs)
            logits = logits[:len(rows)]
        with timer("sample"), torch.inference_mode():
            sampled = eng.sampler.sample(logits, sampling, plan)
            sampled.start_host_copy()
        return sampled

    def _host_work(self, ran: _Ran | None, batch: SchedulerOutput, sampling: list[Sequence]
                   ) -> tuple[list[RequestOutput], _Staged | None, dict[int, int]]:
        """The helper's part of an overlapped step (steps 1-3 of the module doc)."""
        eng = self.engine
        timer = PhaseTimer(eng.stats.time_s)
        with timer("postprocess"):
            outputs = self._resolve(ran) if ran is not None else []
            placeholder_rows: dict[int, int] = {}
            for row, seq in enumerate(sampling):
                if not seq.is_finished and not self._ends_by_length(seq):
                    seq.append_token(PLACEHOLDER_TOKEN_ID)
                    placeholder_rows[seq.seq_id] = row
            eng.scheduler.finish_step(batch)
        with timer("schedule"):
            following = eng.schedule()
        if not following.scheduled:
            return outputs, None, placeholder_rows
        with timer("prepare"):
            staged = eng.runner.stage(following.scheduled, placeholder_rows)
        return outputs, _Staged(following, staged), placeholder_rows

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Its next token is its last whatever it is (max_tokens, max_model_len)."""
        max_tokens = seq.sampling_params.max_tokens
        return ((max_tokens is not None and seq.num_output_tokens + 1 >= max_tokens)
                or seq.num_tokens + 1 >= self.engine.max_model_len)

    def _resolve_ran(self) -> list[RequestOutput]:
        ran, self._ran = self._ran, None
        return self._resolve(ran) if ran is not None else []

    def _resolve(self, ran: _Ran) -> list[RequestOutput]:
        """Read a step's tokens (the step's one device-to-host copy), put them in
        place of the placeholders, check stops, retire what finished, build outputs.
        Rows of sequences already finished (aborted, or ended a step earlier while
        this step computed their extra token) are dropped."""
        eng = self.engine
        out = eng.sampler.fetch(ran.sampled)
        emitted = []
        for seq, token_id, logprobs in zip(ran.seqs, out.token_ids, out.logprobs):
            if seq.seq_id in ran.placeholder_rows and seq.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                seq.token_ids.pop()  # resolve puts the real token in its place
            if not seq.is_finished:
                emitted.append((seq, [token_id], [logprobs]))
        return eng.resolve(emitted)  # the scheduler is past this step: retires what finished
