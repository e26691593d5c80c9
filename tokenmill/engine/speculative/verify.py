"""Verification: which proposed tokens the target accepts, and the token after them.

The target scored, in one forward, the sequence's last real token and its m
proposed tokens d_0..d_{m-1}: row j of `logits` (m + 1, V) is the target's
distribution for the token after d_{j-1} (row 0: after the real token).

Every proposer here is deterministic (a point mass q on d_j), so speculative
sampling (Leviathan et al. 2023; Chen et al. 2023) reduces to: accept d_j with
probability p_j(d_j); at the first rejection, draw from p_j with d_j removed
and renormalized; if all m are accepted, draw a bonus token from p_m. Each
emitted token then has exactly the target's distribution p. Greedy requests
are the same rule with p a point mass on the argmax: accept the longest
prefix that matches the target's argmax, plus the argmax after it.

p_j is the sampler's processed distribution (temperature, min-p, top-k,
top-p); requests with penalties or a pending min_tokens are never proposed
for, since their p_j would depend on which earlier proposals were accepted.
"""

from __future__ import annotations

import torch

from tokenmill.engine.core.sampling_ops import (
    apply_top_k,
    apply_top_p,
    inverse_cdf_draw,
    seed_for,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampler's distribution for each row of `logits` (R, V) under one
    request's (non-greedy) parameters, as probabilities (R, V)."""
    rows = logits.shape[0]
    scaled = logits.float() / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        too_unlikely = probs < params.min_p * probs.max(dim=-1, keepdim=True).values
        scaled.masked_fill_(too_unlikely, float("-inf"))
    if params.top_k > 0:
        apply_top_k(scaled, [params.top_k] * rows)
    if params.top_p < 1.0:
        apply_top_p(scaled, list(range(rows)), [params.top_p] * rows)
    return torch.softmax(scaled, dim=-1)


def verify_greedy(argmax: list[int], drafts: list[int]) -> list[int]:
    """argmax: the target's argmax of each of the m + 1 rows. Returns the
    accepted drafts plus one token from the target (1..m + 1 tokens)."""
    out = []
    for d, best in zip(drafts, argmax):
        if d != best:
            break
        out.append(d)
    out.append(argmax[len(out)])
    return out


def verify_sampled(logits: torch.Tensor, drafts: list[int], seq: Sequence) -> list[int]:
    """logits (m + 1, V) of one sampled sequence. Returns the accepted drafts
    plus one token drawn from the target (1..m + 1 tokens)."""
    probs = target_probs(logits, seq.sampling_params)  # (m + 1, V)
    m = len(drafts)
    uniforms = _uniforms(seq, m + 1)
    p_draft = probs[torch.arange(m), torch.tensor(drafts, dtype=torch.long)].tolist() if m else []
    out: list[int] = []
    for j, (d, p) in enumerate(zip(drafts, p_draft)):
        if uniforms[j] < p:
            out.append(d)
            continue
        residual = probs[j].clone()
        residual[d] = 0.0  # max(0, p - q) for a point mass q on d
        out.append(_draw(residual, uniforms[m]))
        return out
    out.append(_draw(probs[m], uniforms[m]))
    return out


def _draw(probs: torch.Tensor, u: float) -> int:
    # inverse_cdf_draw scales by the row's total: `probs` need not be normalized
    return int(inverse_cdf_draw(probs[None], torch.tensor([u]))[0])


def _uniforms(seq: Sequence, n: int) -> list[float]:
    """From the sequence's own generator if it is seeded (as the sampler does),
    so seeded requests stay reproducible with speculation on."""
    seed = seq.sampling_params.seed
    if seed is None:
        return torch.rand(n).tolist()
    if seq.sampler_state is None:
        seq.sampler_state = torch.Generator().manual_seed(seed_for(seed, seq.index))
    return torch.rand(n, generator=seq.sampler_state).tolist()
