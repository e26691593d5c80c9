"""Verification and proposers without a model: exactness of speculative
sampling, greedy acceptance, prompt lookup, back-off."""

from __future__ import annotations

import math

import torch

from tokenmill.engine.speculative.ngram import NgramProposer
from tokenmill.engine.speculative.stats import BackOff, StepCost
from tokenmill.engine.speculative.verify import target_probs, verify_greedy, verify_sampled
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence


def chi_square_p_value(observed: list[float], expected: list[float]) -> float:
    """Upper tail of the chi-square statistic (Wilson-Hilferty approximation)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(observed) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_greedy_accepts_the_matching_prefix_and_adds_the_targets_token():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert verify_greedy([5, 6], [4]) == [5]


def test_speculative_sampling_emits_exactly_the_targets_distribution():
    """The first two emitted tokens from a target whose next-token
    distribution is p0, then p1 whatever came first, with one likely and one
    arbitrary draft: their joint distribution must be p0(a) * p1(b)."""
    torch.manual_seed(0)
    vocab = 4
    logits = torch.randn(3, vocab) * 1.5
    logits[2] = logits[1]  # p1 after the second draft too: "p1 whatever came first"
    params = SamplingParams(temperature=0.8, top_k=3, seed=123)
    probs = target_probs(logits, params)
    drafts = [int(probs[0].argmax()), 1]
    seq = Sequence("r", [1, 2, 3], params)
    counts: dict[tuple[int, int], int] = {}
    n = 3000
    for _ in range(n):
        out = verify_sampled(logits, drafts, seq)
        if len(out) == 1:  # first draft rejected: the next step would draw from p1
            out.append(int(torch.multinomial(probs[1], 1, generator=seq.sampler_state)))
        counts[(out[0], out[1])] = counts.get((out[0], out[1]), 0) + 1
    cells = [(a, b) for a in range(vocab) for b in range(vocab) if probs[0, a] * probs[1, b] > 0]
    expected = [n * float(probs[0, a] * probs[1, b]) for a, b in cells]
    observed = [counts.get(c, 0) for c in cells]
    assert sum(observed) == n  # nothing outside the top-k support
    assert chi_square_p_value(observed, expected) > 1e-3


def test_speculative_sampling_first_token_matches_when_every_draft_is_wrong():
    torch.manual_seed(1)
    logits = torch.randn(2, 5)
    params = SamplingParams(temperature=1.0, seed=7)
    probs = target_probs(logits, params)
    draft = int(probs[0].argmin())  # the least likely token
    seq = Sequence("r", [1], params)
    n = 3000
    counts = [0] * 5
    for _ in range(n):
        counts[verify_sampled(logits, [draft], seq)[0]] += 1
    assert chi_square_p_value(counts, [n * float(p) for p in probs[0]]) > 1e-3


def test_ngram_proposes_what_followed_the_latest_match():
    ngram = NgramProposer(ngram_min=2, ngram_max=3)
    seq = Sequence("r", [9, 1, 2, 3, 4, 5, 7, 1, 2, 3, 8, 1, 2, 3], SamplingParams())
    assert ngram.propose([seq], [2]) == [[8, 1]]  # latest [1, 2, 3] wins
    seq = Sequence("r", [1, 2, 7, 8, 0, 2, 7], SamplingParams())
    assert ngram.propose([seq], [4]) == [[8, 0, 2, 7]]  # falls back to n = 2
    assert ngram.propose([Sequence("r", [1, 2, 3, 4], SamplingParams())], [4]) == [[]]


def test_back_off_rests_longer_each_time_and_a_good_step_resets_it():
    b = BackOff()
    b.update(4, 0)
    b.update(4, 0)
    assert b.ewma < 0.5
    b.rest(prior=0.9)
    assert [b.ready() for _ in range(5)] == [False] * 4 + [True]
    assert b.ewma == BackOff().ewma  # probes afresh
    b.rest(prior=0.1)
    assert b.cooldown == 8 and b.ewma == 0.1  # nothing pays for anyone: no probe yet
    b.update(4, 4)
    assert b.backoff_steps == 4
    for _ in range(5):
        b.rest(prior=0.0)
    assert b.cooldown == BackOff.MAX_BACKOFF_STEPS
    assert b.ewma == BackOff().ewma  # after the longest rest it probes regardless


def test_step_cost_picks_k_by_measured_cost_and_acceptance():
    cost = StepCost()
    assert cost.best_k(0.9, 1, 4) == 4  # nothing measured yet: try the most
    for t in range(1, 6):  # a forward of t tokens costs like 1 + 0.3 (t - 1)
        cost.record(t, 0.01 * (1 + 0.3 * (t - 1)))
    assert cost.best_k(0.95, 1, 4) == 4
    assert 0 < cost.best_k(0.6, 1, 4) < 4
    assert cost.best_k(0.2, 1, 4) == 0  # 1.2 tokens for 1.3x the time: no
