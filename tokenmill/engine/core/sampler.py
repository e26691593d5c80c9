"""Logits -> next token ids (+ logprobs), batched, with per-request parameters.

Order of operations on a row (as vLLM): constraints (tokenmill/structured:
grammar bitmask, logit_bias, allowed_token_ids, bad_words) -> min_tokens mask -> repetition,
frequency and presence penalties -> greedy argmax, or temperature -> min-p ->
top-k -> top-p -> one inverse-CDF draw. Logprobs are always those of the
model's own distribution: log_softmax of the raw logits, before any penalty,
mask or temperature.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.engine.core.outputs import Logprob
from tokenmill.engine.core.sampling_ops import (
    apply_penalties,
    apply_top_k,
    apply_top_p,
    has_penalty,
    inverse_cdf_draw,
    pack,
    seed_for,
    unpack,
)
from tokenmill.engine.runner.staging import HostCopy
from tokenmill.kernels import layer_ops
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: None, or {token id: Logprob} with the chosen token and the top-k
    logprobs: list[dict[int, Logprob] | None]


@dataclass
class SamplingPlan:
    """The host side of one step's sampling, fixed before the step runs."""

    params: list[SamplingParams]
    blocked: list[tuple[int, list[int]]]  # (row, token ids) min_tokens forbids
    penalized: list[int]  # rows with repetition / frequency / presence penalties
    greedy: bool  # every row is a plain argmax
    uniforms: torch.Tensor | None  # (N,) one U[0, 1) per row; None if all rows are greedy


@dataclass
class SampledBatch:
    """One step's samples where the logits are: `token_ids` (N,) int64 feeds the next
    step's inputs on the device; `packed` is what `Sampler.fetch` copies to the host."""

    token_ids: torch.Tensor
    # (N, 1 + 2 + 2k) float64: ids, chosen logprob, rank, top k; (N,) the ids themselves
    # when no row asked for logprobs
    packed: torch.Tensor
    num_logprobs: list[int | None]
    host_copy: HostCopy | None = None  # `start_host_copy`: queued, not yet waited for

    def start_host_copy(self) -> None:
        """Queue the copy `Sampler.fetch` reads, right behind this step's work."""
        self.host_copy = HostCopy(self.packed)


class Constraints(Protocol):
    def apply(self, logits: torch.Tensor, seqs: SequenceLike[Sequence]) -> torch.Tensor: ...


class Sampler:
    """`Sampler(eos_token_ids)(logits, seqs)`: one new token per row.

    A seeded sequence owns a CPU torch.Generator in `seq.sampler_state`
    (seeded from (seed, seq.index)) and draws its row's single uniform from
    it, so its tokens do not depend on what else is in the batch; unseeded
    rows draw from torch's global CPU generator.
    """

    def __init__(self, eos_token_ids: Iterable[int] = (),
                 constraints: Constraints | None = None) -> None:
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.constraints = constraints

    def __call__(self, logits: torch.Tensor, seqs: SequenceLike[Sequence]) -> SamplerOutput:
        return self.fetch(self.sample(logits, seqs, self.plan(seqs)))

    def plan(self, seqs: SequenceLike[Sequence]) -> SamplingPlan:
        """What sampling these rows reads from the host: taken before the step runs,
        so that the sequences may change (async scheduling) while it does."""
        params = [s.sampling_params for s in seqs]
        blocked = self._blocked_stop_ids(seqs)
        penalized = [i for i, p in enumerate(params) if has_penalty(p)]
        greedy = all(p.greedy for p in params) and not penalized and not blocked
        uniforms = None if all(p.greedy for p in params) else self._uniforms(seqs)
        return SamplingPlan(params, blocked, penalized, greedy, uniforms)

    def sample(self, logits: torch.Tensor, seqs: SequenceLike[Sequence],
               plan: SamplingPlan) -> SampledBatch:
        """The chosen ids (and requested logprobs) where the logits are; no host copy.
        Reads from `seqs` only what constraints and penalties need (async
        scheduling runs the rows that have them synchronously)."""
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), (logits.shape, len(seqs))
        logits = logits.float()  # (N, V)
        num_logprobs = [p.logprobs for p in plan.params]
        raw_logprobs = None
        if any(k is not None for k in num_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # (N, V)
        if self.constraints is not None:
            logits = self.constraints.apply(logits, seqs)
        if plan.greedy:
            token_ids = _argmax(logits)  # (N,)
        else:
            token_ids = self._sample(logits, seqs, plan)
        return SampledBatch(token_ids, pack(token_ids, raw_logprobs, num_logprobs),
                            num_logprobs)

    @staticmethod
    def fetch(sampled: SampledBatch) -> SamplerOutput:
        """The one device-to-host copy of a step."""
        host = (sampled.host_copy.result() if sampled.host_copy is not None
                else sampled.packed.cpu())
        token_list, logprobs = unpack(host.tolist(), sampled.num_logprobs)
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    def _blocked_stop_ids(self, seqs: SequenceLike[Sequence]) -> list[tuple[int, list[int]]]:
        """(row, token ids) that min_tokens forbids this step."""
        blocked = []
        for row, seq in enumerate(seqs):
            p = seq.sampling_params
            if seq.num_output_tokens >= p.min_tokens:
                continue
            ids = list(p.stop_token_ids)
            if not p.ignore_eos:
                ids += self.eos_token_ids
            if ids:
                blocked.append((row, ids))
        return blocked

    def _sample(self, logits: torch.Tensor, seqs: SequenceLike[Sequence],  # (N, V)
                plan: SamplingPlan) -> torch.Tensor:
        vocab = logits.shape[1]
        device = logits.device
        params, blocked, penalized = plan.params, plan.blocked, plan.penalized
        if blocked or penalized:
            logits = logits.clone()  # the caller's logits stay untouched
        if blocked:
            rows = [r for r, ids in blocked for t in ids if 0 <= t < vocab]
            cols = [t for _, ids in blocked for t in ids if 0 <= t < vocab]
            logits[rows, cols] = float("-inf")
        if penalized:
            apply_penalties(logits, [seqs[i] for i in penalized], penalized)

        greedy = [p.greedy for p in params]
        if all(greedy):
            return _argmax(logits)

        temps = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
        assert plan.uniforms is not None
        filters = _Filters.of(params, greedy)
        sampled = None
        if not filters.any:
            # no filter: the native draw reads the logits twice and writes nothing (torch's
            # softmax and cumulative sums: ~2.5 ms a step over 16 x 262k logits)
            sampled = layer_ops.sample(logits, temps, plan.uniforms)
        if sampled is None:
            sampled = _filtered_draw(logits, params, filters, temps, plan.uniforms)
        if any(greedy):
            is_greedy = torch.tensor(greedy, device=device)
            sampled = torch.where(is_greedy, _argmax(logits), sampled)
        return sampled

    def _uniforms(self, seqs: SequenceLike[Sequence]) -> torch.Tensor:
        """One U[0, 1) per row, on CPU: from the row's own generator if seeded."""
        u = torch.rand(len(seqs))
        for row, seq in enumerate(seqs):
            seed = seq.sampling_params.seed
            if seed is None or seq.sampling_params.greedy:
                continue
            if seq.sampler_state is None:
                seq.sampler_state = torch.Generator().manual_seed(seed_for(seed, seq.index))
            u[row] = torch.rand(1, generator=seq.sampler_state)[0]
        return u


def _argmax(logits: torch.Tensor) -> torch.Tensor:  # (N, V) -> (N,)
    """torch.argmax over the vocabulary, natively for fp32 CPU logits (the same ids,
    a third of the time: layer_ops.argmax)."""
    ids = layer_ops.argmax(logits)
    return ids if ids is not None else logits.argmax(dim=-1)


@dataclass
class _Filters:
    """Which of a batch's rows filter their distribution before the draw."""

    min_p: bool  # some row has min_p
    top_k: bool  # some row has top_k
    top_p_rows: list[int]  # the random rows with top_p < 1

    @staticmethod
    def of(params: list[SamplingParams], greedy: list[bool]) -> _Filters:
        return _Filters(any(p.min_p > 0.0 for p in params), any(p.top_k > 0 for p in params),
                        [i for i, p in enumerate(params) if p.top_p < 1.0 and not greedy[i]])

    @property
    def any(self) -> bool:
        return self.min_p or self.top_k or bool(self.top_p_rows)


def _filtered_draw(logits: torch.Tensor, params: list[SamplingParams], filters: _Filters,
                   temps: list[float], uniforms: torch.Tensor) -> torch.Tensor:
    """torch's draw: temperature, then min-p, top-k and top-p, then the inverse CDF."""
    vocab, device = logits.shape[1], logits.device
    top_p_rows = filters.top_p_rows
    if all(t == 1.0 for t in temps):
        # x / 1.0 is x: skip a pass over the (N, V) logits (16 x 262k fp32 is 1.3 ms
        # a step on 2 cores); a copy only where the filters below write in place
        scaled = logits.clone() if filters.any else logits
    else:
        scaled = logits / torch.tensor(temps, device=device)[:, None]
    if filters.min_p:
        min_p = torch.tensor([p.min_p for p in params], device=device)
        probs = torch.softmax(scaled, dim=-1)
        too_unlikely = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        scaled.masked_fill_(too_unlikely, float("-inf"))
    if filters.top_k:
        apply_top_k(scaled, [p.top_k if p.top_k > 0 else vocab for p in params])
    if top_p_rows:
        apply_top_p(scaled, top_p_rows, [params[i].top_p for i in top_p_rows])
    return inverse_cdf_draw(torch.softmax(scaled, dim=-1), uniforms)
