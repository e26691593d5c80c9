"""The scheduler: who runs this step, and with how many tokens.

One rule for every sequence: it still needs `seq.num_tokens -
seq.num_computed_tokens` tokens fed to the model (a whole prompt, the rest of
a chunked prompt, one decode token, or prompt + output again after a
preemption). Each step gets one flat batch within `max_num_batched_tokens`
and `max_num_seqs`: running sequences first, in admission order, then
waiting ones in FIFO order; a prompt longer than the budget left gets a
chunk and continues next step. A sequence samples when its chunk reaches
its last token.

When a running sequence cannot get blocks, the most recently admitted
running sequence is preempted by recompute: its blocks are freed, its
`num_computed_tokens` goes to 0 and it goes back to the FRONT of the waiting
queue with its generated tokens kept, so it later recomputes prompt +
output and carries on. Plain Python, no torch.

Call order per engine step:
  1. `out = scheduler.schedule()`
  2. the model runner runs `out.scheduled`: for each entry, the tokens
     `seq.token_ids[seq.num_computed_tokens:][:num_new_tokens]` at positions
     starting at `seq.num_computed_tokens` (not yet advanced), into the slots
     of `seq.block_table`; logits only for entries with `sample=True`
  3. the engine appends each sampled token (`seq.append_token`) and calls
     `seq.finish(reason)` on the sequences that stop
  4. `scheduler.finish_step(out)`: advances `num_computed_tokens`, registers full
     blocks in the prefix cache, frees and drops finished sequences
`abort(request_id)` may be called between steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.config import SchedulerConfig
from tokenmill.kvcache.block_manager import BlockManager
from tokenmill.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens fed to the model this step, from num_computed_tokens on
    sample: bool  # this step computes the sequence's last token: sample the next one
    # speculative decoding: the last num_draft_tokens of the chunk are proposals
    # (tokenmill/engine/speculative), scored too: logits for each of them and the token before
    num_draft_tokens: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0  # cumulative
        # called with each finished sequence before its blocks are freed (a KV transfer
        # pins a prefill's blocks there: engine/core/kv_transfer.py)
        self.on_finished: Callable[[Sequence], None] | None = None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. The engine rejects beforehand any request whose
        prompt + max_tokens exceeds `block_manager.max_tokens_that_fit()`."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request with reason "abort" and free its
        blocks now; return those sequences (none if it is unknown or done)."""
        aborted = [s for s in (*self.waiting, *self.running) if s.request_id == request_id]
        if not aborted:
            return []
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        self.running = [s for s in self.running if s.request_id != request_id]
        for seq in aborted:
            self.block_manager.free(seq)
            if not seq.is_finished:
                seq.finish("abort")
        return aborted

    def retire(self, seqs: list[Sequence]) -> None:
        """Free and drop finished sequences now, running or (preempted) waiting:
        async scheduling learns that a sequence finished after the next step,
        which still computes it, was scheduled. Their rows of that step are then
        skipped by `finish_step`, as an abort's are."""
        done = {id(s) for s in seqs}
        self.running = [s for s in self.running if id(s) not in done]
        if any(id(s) in done for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if id(s) not in done)
        for seq in seqs:
            self._free_finished(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        # Admitting right after a preemption would only thrash: the preempted
        # sequence is at the head of the queue and gave up its blocks just now.
        if not out.preempted:
            self._schedule_waiting(out, budget)
        if out.is_empty and self.waiting and not self.running:
            seq = self.waiting[0]
            raise RuntimeError(
                f"{seq!r} cannot fit in an empty KV cache of "
                f"{self.block_manager.max_tokens_that_fit()} tokens; reject such "
                "requests at add time with BlockManager.max_tokens_that_fit()")
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()  # the most recently admitted; never one scheduled
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget
            out.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            prefix = bm.get_computed_blocks(seq)
            num_new = min(seq.num_tokens - prefix.num_tokens, budget)
            if not self.config.enable_chunked_prefill and num_new < seq.num_tokens - prefix.num_tokens:
                break  # the whole prompt in one step, or wait for a step with room
            if not self._adapter_fits(seq):
                break  # --max-loras adapters already run: FIFO, wait for one to finish
            if not bm.allocate_slots(seq, num_new, prefix):
                break  # FIFO: no one overtakes the head of the queue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            out.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new

    def _adapter_fits(self, seq: Sequence) -> bool:
        lora_id = seq.lora_int_id
        if not lora_id or not self.config.max_loras:
            return True
        running = {s.lora_int_id for s in self.running} - {0}
        return lora_id in running or len(running) < self.config.max_loras

    @staticmethod
    def _scheduled(seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
        sample = seq.num_computed_tokens + num_new_tokens >= seq.num_tokens
        return ScheduledSeq(seq, num_new_tokens, sample)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _free_finished(self, seq: Sequence) -> None:
        if self.on_finished is not None:
            self.on_finished(seq)
        self.block_manager.free(seq)

    def finish_step(self, out: SchedulerOutput) -> list[Sequence]:
        """After the model ran and the engine appended tokens / finished sequences:
        advance each scheduled sequence, cache its full blocks, free the finished.
        Returns the sequences that finished (and were dropped) this step."""
        for s in out.scheduled:
            if s.seq.is_finished and not s.seq.block_table:
                continue  # aborted while the step ran: already freed
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(s.seq)
        finished = [seq for seq in self.running if seq.is_finished]
        if finished:
            for seq in finished:
                self._free_finished(seq)
            self.running = [seq for seq in self.running if not seq.is_finished]
        return finished
