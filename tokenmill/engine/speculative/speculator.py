"""The engine's one handle on speculative decoding: four calls per step.

  1. `extend(batch, num_running)` after `scheduler.schedule()`: for each
     decoding sequence, ask the proposer for up to k tokens, grow its KV slots
     to 1 + m (never preempting anyone: no free blocks, no proposal), append
     the m drafts to `seq.token_ids` *provisionally* and widen its
     `ScheduledSeq` to 1 + m tokens with `num_draft_tokens = m`. The model
     runner then feeds and scores them like any other tokens and returns
     logits for all m + 1 positions.
  2. `verify(batch, logits, sampler)` after the forward: strips the drafts
     again and returns, per sampling sequence, the tokens to append (the
     accepted drafts + one from the target; plain sampler rows for the rest).
  3. the engine appends those one at a time, with a stop check after each.
  4. `rollback(batch)` before `scheduler.finish_step`: narrows each widened
     `ScheduledSeq` to the tokens whose KV is valid (the real token + the
     accepted drafts, and never the last appended token) and frees the KV
     slots past them, so `num_computed_tokens` and block accounting are exact.
`forget(seqs)` on abort. Drafts live in `token_ids` only between 1 and 2, so
preemption, abort and the prefix cache never see them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from tokenmill.engine.core.sampler import Sampler
from tokenmill.engine.core.sampling_ops import gather_logprobs, has_penalty
from tokenmill.engine.core.scheduler import ScheduledSeq, SchedulerOutput
from tokenmill.engine.speculative.proposer import Proposer
from tokenmill.engine.speculative.stats import BackOff, SpecStats, StepCost
from tokenmill.engine.speculative.verify import verify_greedy, verify_sampled
from tokenmill.kvcache.block_manager import BlockManager
from tokenmill.sequence import Sequence

# (sequence, token ids to append in order, their logprobs or Nones)
Emitted = tuple[Sequence, list[int], list[Any]]


class Speculator:
    def __init__(self, proposer: Proposer, block_manager: BlockManager,
                 num_speculative_tokens: int, max_num_batched_tokens: int,
                 max_model_len: int, spec_max_batch: int) -> None:
        self.proposer = proposer
        self.block_manager = block_manager
        self.k = num_speculative_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.spec_max_batch = spec_max_batch
        self.stats = SpecStats()
        self._backoff: dict[int, BackOff] = {}
        self._accepted: dict[int, int] = {}  # seq_id -> drafts accepted this step
        self.step_cost = StepCost()
        self.adaptive = True  # False: always propose k (tests of exactness, experiments)
        # acceptance over all sequences (see Proposer.runs_a_model)
        self.prior_acceptance = BackOff.ewma
        self._step_start: tuple[float, int] | None = None  # (perf_counter, decode-only tokens)

    # ---- 1. before the forward ---------------------------------------------------

    def extend(self, batch: SchedulerOutput, num_running: int) -> None:
        start = time.perf_counter()
        self._step_start = None
        if batch.preempted:
            self.forget(batch.preempted)
        if num_running > self.spec_max_batch:
            return
        decode_only = all(self._is_decode(item) for item in batch.scheduled)
        base_tokens = batch.num_batched_tokens
        budget = self.max_num_batched_tokens - base_tokens
        items, limits = [], []
        for item in batch.scheduled:
            k = self._limit(item, base_tokens) if budget > 0 and decode_only else 0
            k = min(k, budget)
            # check, then commit: slots for 1 + k tokens or no proposal at all
            if k > 0 and self.block_manager.allocate_slots(item.seq, 1 + k):
                items.append(item)
                limits.append(k)
                budget -= k
        if not items:
            return
        proposals = self.proposer.propose([it.seq for it in items], limits)
        for item, k, drafts in zip(items, limits, proposals):
            seq = item.seq
            drafts = [int(t) for t in drafts[:k]]
            if len(drafts) < k:
                self.block_manager.free_slots_beyond(seq, seq.num_computed_tokens + 1 + len(drafts))
            if drafts:
                seq.token_ids.extend(drafts)
                item.num_new_tokens += len(drafts)
                item.num_draft_tokens = len(drafts)
        if decode_only:  # verify() times proposing + forward for the step's token count
            self._step_start = (start, batch.num_batched_tokens)

    def _prior(self) -> float:
        return min(BackOff.ewma, self.prior_acceptance) if self.proposer.runs_a_model \
            else BackOff.ewma

    @staticmethod
    def _is_decode(item: ScheduledSeq) -> bool:
        return item.sample and item.num_new_tokens == 1  # not a prompt chunk or a recompute

    def _limit(self, item: ScheduledSeq, base_tokens: int) -> int:
        """How many drafts this sequence may get this step (0: none)."""
        seq = item.seq
        p = seq.sampling_params
        if has_penalty(p) or seq.num_output_tokens < p.min_tokens:
            return 0  # the target's distribution would depend on the accepted drafts
        if p.has_logit_constraints:
            return 0  # drafts are verified against the unconstrained target: decode plainly
        backoff = self._backoff.get(seq.seq_id)
        if backoff is None:
            backoff = self._backoff[seq.seq_id] = BackOff(ewma=self._prior())
        if not backoff.ready():
            return 0
        # the step emits up to k + 1 tokens: stay within max_tokens and the context
        room = self.max_model_len - seq.num_tokens - 1
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - seq.num_output_tokens - 1)
        if room < 1:
            return 0
        if not self.adaptive:
            return min(self.k, room)
        k = 0
        if backoff.ewma >= self.proposer.min_acceptance:
            k = self.step_cost.best_k(backoff.ewma, base_tokens, min(self.k, room))
        if k == 0:  # not worth it at this acceptance: rest, then probe again
            backoff.rest(self._prior())
        return k

    # ---- 2. after the forward ----------------------------------------------------

    def verify(self, batch: SchedulerOutput, logits: torch.Tensor,
               sampler: Sampler) -> list[Emitted]:
        """logits: the runner's rows, 1 + num_draft_tokens per sampling entry."""
        if self._step_start is not None:
            start, num_tokens = self._step_start
            self.step_cost.record(num_tokens, time.perf_counter() - start)
        sampling = [item for item in batch.scheduled if item.sample]
        if not any(item.num_draft_tokens for item in sampling):
            out = sampler(logits, [item.seq for item in sampling])
            return [(item.seq, [t], [lp])
                    for item, t, lp in zip(sampling, out.token_ids, out.logprobs)]
        starts, row = [], 0
        for item in sampling:
            starts.append(row)
            row += 1 + item.num_draft_tokens
        assert row == logits.shape[0], (row, logits.shape)
        plain = [i for i, item in enumerate(sampling) if not item.num_draft_tokens]
        emitted: list[Emitted | None] = [None] * len(sampling)
        if plain:
            rows = torch.tensor([starts[i] for i in plain], device=logits.device)
            out = sampler(logits.index_select(0, rows), [sampling[i].seq for i in plain])
            for i, token_id, lp in zip(plain, out.token_ids, out.logprobs):
                emitted[i] = (sampling[i].seq, [token_id], [lp])
        greedy_argmax = logits.argmax(dim=-1).tolist()
        for i, item in enumerate(sampling):
            if item.num_draft_tokens:
                rows_i = logits[starts[i]:starts[i] + 1 + item.num_draft_tokens]
                emitted[i] = self._verify_one(item, rows_i,
                                              greedy_argmax[starts[i]:starts[i] + len(rows_i)])
        return [e for e in emitted if e is not None]

    def _verify_one(self, item: ScheduledSeq, rows: torch.Tensor, argmax: list[int]) -> Emitted:
        seq, m = item.seq, item.num_draft_tokens
        drafts = seq.token_ids[-m:]
        del seq.token_ids[-m:]
        params = seq.sampling_params
        tokens = verify_greedy(argmax, drafts) if params.greedy else verify_sampled(rows, drafts, seq)
        num_accepted = len(tokens) - 1
        self._accepted[seq.seq_id] = num_accepted
        self.stats.num_proposed_tokens += m
        self.stats.num_accepted_tokens += num_accepted
        self.stats.num_verified_steps += 1
        self._backoff.setdefault(seq.seq_id, BackOff()).update(m, num_accepted)
        self.prior_acceptance += BackOff.WEIGHT * (num_accepted / m - self.prior_acceptance)
        logprobs: list[Any] = [None] * len(tokens)
        if params.logprobs is not None:
            n = len(tokens)
            raw = torch.log_softmax(rows[:n].float(), dim=-1)  # (n, V)
            logprobs = gather_logprobs(raw, torch.tensor(tokens, device=raw.device),
                                        [params.logprobs] * n)
        return seq, tokens, logprobs

    # ---- 4. before finish_step ---------------------------------------------------

    def rollback(self, batch: SchedulerOutput) -> None:
        done = []
        for item in batch.scheduled:
            seq = item.seq
            if item.num_draft_tokens:
                num_accepted = self._accepted.pop(seq.seq_id, 0)
                item.num_new_tokens -= item.num_draft_tokens - num_accepted
                item.num_draft_tokens = 0
                # a stop inside the accepted drafts: the tokens after it were not kept
                item.num_new_tokens = min(item.num_new_tokens,
                                          seq.num_tokens - 1 - seq.num_computed_tokens)
                if seq.block_table:  # not aborted while the step ran
                    self.block_manager.free_slots_beyond(
                        seq, seq.num_computed_tokens + item.num_new_tokens)
            if seq.is_finished:
                done.append(seq)
        if done:
            self.forget(done)

    def forget(self, seqs: Seq[Sequence]) -> None:
        for seq in seqs:
            self._backoff.pop(seq.seq_id, None)
        self.proposer.forget(list(seqs))
