"""Logits -> next token ids (+ logprobs), batched, with per-request parameters.

Order of operations on a row (as vLLM): constraints (tokenmill/structured:
grammar bitmask, logit_bias, allowed_token_ids, bad_words) -> min_tokens mask -> repetition,
frequency and presence penalties -> greedy argmax, or temperature -> min-p ->
top-k -> top-p -> one inverse-CDF draw. Logprobs are always those of the
model's own distribution: log_softmax of the raw logits, before any penalty,
mask or temperature.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.engine.core.outputs import Logprob
from tokenmill.engine.runner.staging import HostCopy
from tokenmill.kernels import layer_ops
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence

# A draw needs a cumulative sum over the vocabulary; doing it in two levels
# (sums of blocks, then a cumsum inside the one chosen block) keeps a
# (16, 49152) draw well under a millisecond on CPU, where a flat cumsum,
# torch.multinomial or an exponential race take several.
_CDF_BLOCK = 256
# top-p first looks at the most likely tokens only (a model's distribution
# usually reaches p within a few hundred); a full sort is the last resort.
_TOP_P_CANDIDATES = (256, 4096)


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


def _seed_for(seed: int, index: int) -> int:
    # Distinct, reproducible streams for the n samples of one seeded request.
    return (seed * 0x9E3779B97F4A7C15 + index) % (2**63)


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
        penalized = [i for i, p in enumerate(params) if _has_penalty(p)]
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
        return SampledBatch(token_ids, _pack(token_ids, raw_logprobs, num_logprobs),
                            num_logprobs)

    @staticmethod
    def fetch(sampled: SampledBatch) -> SamplerOutput:
        """The one device-to-host copy of a step."""
        host = (sampled.host_copy.result() if sampled.host_copy is not None
                else sampled.packed.cpu())
        token_list, logprobs = _unpack(host.tolist(), sampled.num_logprobs)
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
            _apply_penalties(logits, [seqs[i] for i in penalized], penalized)

        greedy = [p.greedy for p in params]
        if all(greedy):
            return _argmax(logits)

        temps = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                             device=device)
        scaled = logits / temps[:, None]
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
            probs = torch.softmax(scaled, dim=-1)
            too_unlikely = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            scaled.masked_fill_(too_unlikely, float("-inf"))
        if any(p.top_k > 0 for p in params):
            _apply_top_k(scaled, [p.top_k if p.top_k > 0 else vocab for p in params])
        top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0 and not greedy[i]]
        if top_p_rows:
            _apply_top_p(scaled, top_p_rows, [params[i].top_p for i in top_p_rows])

        assert plan.uniforms is not None
        sampled = _inverse_cdf_draw(torch.softmax(scaled, dim=-1), plan.uniforms)
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
                seq.sampler_state = torch.Generator().manual_seed(_seed_for(seed, seq.index))
            u[row] = torch.rand(1, generator=seq.sampler_state)[0]
        return u


def _argmax(logits: torch.Tensor) -> torch.Tensor:  # (N, V) -> (N,)
    """torch.argmax over the vocabulary, natively for fp32 CPU logits (the same ids,
    a third of the time: layer_ops.argmax)."""
    ids = layer_ops.argmax(logits)
    return ids if ids is not None else logits.argmax(dim=-1)


def _has_penalty(p: SamplingParams) -> bool:
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0)


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """Repetition penalty (HF/vLLM: over prompt + output; logit > 0 is divided,
    else multiplied), then OpenAI frequency and presence penalties (output only).

    Touches only the token ids that occur, so the cost follows the sequences'
    lengths, not the vocabulary.
    """
    vocab = logits.shape[1]
    device = logits.device
    rep_rows: list[int] = []
    rep_cols: list[int] = []
    rep_vals: list[float] = []
    add_rows: list[int] = []
    add_cols: list[int] = []
    add_vals: list[float] = []
    for row, seq in zip(rows, seqs):
        p = seq.sampling_params
        if p.repetition_penalty != 1.0:
            seen = [t for t in set(seq.token_ids) if 0 <= t < vocab]
            rep_rows += [row] * len(seen)
            rep_cols += seen
            rep_vals += [p.repetition_penalty] * len(seen)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            for tok, count in Counter(seq.output_token_ids).items():
                if 0 <= tok < vocab:
                    add_rows.append(row)
                    add_cols.append(tok)
                    add_vals.append(-(p.frequency_penalty * count + p.presence_penalty))
    if rep_rows:
        r = torch.tensor(rep_rows, device=device)
        c = torch.tensor(rep_cols, device=device)
        penalty = torch.tensor(rep_vals, device=device)
        v = logits[r, c]
        logits[r, c] = torch.where(v > 0, v / penalty, v * penalty)
    if add_rows:
        r = torch.tensor(add_rows, device=device)
        c = torch.tensor(add_cols, device=device)
        logits[r, c] += torch.tensor(add_vals, device=device)


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> None:
    """Mask all but each row's k largest logits (ties with the k-th are kept)."""
    vocab = logits.shape[1]
    k = torch.tensor(top_k, device=logits.device).clamp_(1, vocab)  # (N,)
    top = logits.topk(int(k.max()), dim=-1).values  # (N, k_max), sorted descending
    kth = top.gather(1, (k - 1)[:, None])  # (N, 1)
    logits.masked_fill_(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, rows: list[int], top_p: list[float]) -> None:
    """Keep each row's smallest set of most likely tokens whose probability sum
    reaches p (at least one; ties with the last kept token are kept)."""
    vocab = logits.shape[1]
    probs = torch.softmax(logits[rows], dim=-1)  # (R, V)
    p = torch.tensor(top_p, device=logits.device)[:, None]  # (R, 1)
    for num_candidates in (*_TOP_P_CANDIDATES, vocab):
        if num_candidates >= vocab:
            vals = probs.sort(dim=-1, descending=True).values  # (R, V)
        else:
            vals = probs.topk(num_candidates, dim=-1).values  # (R, C) descending
        cum = vals.cumsum(dim=-1)
        if num_candidates >= vocab or bool((cum[:, -1:] >= p).all()):
            break
    # number of tokens needed to reach p, minus one; clamped for rounding at p=1
    last_kept = (cum < p).sum(dim=-1, keepdim=True).clamp_(max=vals.shape[1] - 1)
    threshold = vals.gather(1, last_kept)  # (R, 1)
    sub = logits[rows]
    sub.masked_fill_(probs < threshold, float("-inf"))
    logits[rows] = sub


def _inverse_cdf_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row from `probs` (N, V) with the given U[0, 1) draws (N,).

    Target r = (1 - u) * total is in (0, total]; picking the first index whose
    cumulative sum is >= r can never pick a zero-probability token.
    """
    n, vocab = probs.shape
    pad = (-vocab) % _CDF_BLOCK
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    blocks = probs.view(n, -1, _CDF_BLOCK)  # (N, num_blocks, B)
    block_cum = blocks.sum(dim=-1).cumsum(dim=-1)  # (N, num_blocks)
    r = (1.0 - uniforms.to(probs.device))[:, None] * block_cum[:, -1:]  # (N, 1)
    block = torch.searchsorted(block_cum, r).clamp_(max=block_cum.shape[1] - 1)  # (N, 1)
    before = torch.where(block > 0, block_cum.gather(1, (block - 1).clamp(min=0)),
                         torch.zeros_like(r))
    in_block = blocks.gather(1, block[:, :, None].expand(n, 1, _CDF_BLOCK))[:, 0]  # (N, B)
    in_cum = in_block.cumsum(dim=-1)
    residual = torch.minimum(r - before, in_cum[:, -1:])
    offset = torch.searchsorted(in_cum, residual).clamp_(max=_CDF_BLOCK - 1)
    return (block * _CDF_BLOCK + offset)[:, 0]


def _pack(
    token_ids: torch.Tensor,  # (N,) where the logits are
    logprobs: torch.Tensor | None,  # (N, V) log_softmax of the raw logits, or None
    num_logprobs: list[int | None],
) -> torch.Tensor:
    """The chosen ids and the requested logprobs in one float64 tensor (N, C), computed
    where the logits are, so that one copy brings them to the host (ids < 2^53 stay
    exact). Without logprobs: the ids as they are (no op to run: each tiny op costs
    ~30 us at batch 1 on a CPU, where the step's weights have just swept the caches)."""
    if logprobs is None:
        return token_ids
    chosen = logprobs.gather(1, token_ids[:, None])  # (N, 1)
    ranks = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1  # (N, 1)
    cols = [token_ids.double()[:, None], chosen.double(), ranks.double()]
    k_max = _k_max(num_logprobs, logprobs.shape[1])
    if k_max > 0:
        top = logprobs.topk(k_max, dim=-1)  # (N, k_max) each
        cols += [top.values.double(), top.indices.double()]
    return torch.cat(cols, dim=1)


def _k_max(num_logprobs: list[int | None], vocab: int) -> int:
    return min(max((k for k in num_logprobs if k is not None), default=0), vocab)


def _unpack(host: list, num_logprobs: list[int | None]
            ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
    """`_pack`'s rows (or ids), on the host, as token ids and logprobs entries."""
    if host and not isinstance(host[0], list):  # the ids alone
        return host, [None] * len(host)
    token_list = [int(row[0]) for row in host]
    if all(k is None for k in num_logprobs):
        return token_list, [None] * len(host)
    k_max = (len(host[0]) - 3) // 2 if host else 0
    out: list[dict[int, Logprob] | None] = []
    for row, k, tok in zip(host, num_logprobs, token_list):
        if k is None:
            out.append(None)
            continue
        entry = {tok: Logprob(logprob=row[1], rank=int(row[2]))}
        top_vals, top_ids = row[3:3 + k_max][:k], row[3 + k_max:][:k]
        for i, (tid, val) in enumerate(zip(top_ids, top_vals)):
            entry.setdefault(int(tid), Logprob(logprob=val, rank=i + 1))
        out.append(entry)
    return token_list, out


def _fetch(
    token_ids: torch.Tensor,  # (N,) where the logits are
    logprobs: torch.Tensor | None,  # (N, V) log_softmax of the raw logits, or None
    num_logprobs: list[int | None],
) -> tuple[list[int], list[dict[int, Logprob] | None]]:
    """The chosen ids and the requested logprobs, brought to the host in one copy."""
    host = _pack(token_ids, logprobs, num_logprobs).cpu().tolist()
    return _unpack(host, num_logprobs)


def _gather_logprobs(
    logprobs: torch.Tensor,  # (N, V) log_softmax of the raw logits
    token_ids: torch.Tensor,  # (N,)
    num_logprobs: list[int | None],
) -> list[dict[int, Logprob] | None]:
    """The logprobs entries of given tokens (speculative verification's accepted ones)."""
    return _fetch(token_ids, logprobs, num_logprobs)[1]
