"""Speculation counters and the per-sequence back-off."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    num_proposed_tokens: int = 0  # draft tokens the target verified
    num_accepted_tokens: int = 0  # of those, accepted
    num_verified_steps: int = 0  # (sequence, step) pairs that verified >= 1 draft token

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_proposed_tokens if self.num_proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculating step: accepted drafts + the target's own."""
        if not self.num_verified_steps:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_verified_steps


@dataclass
class BackOff:
    """Per sequence: an exponentially weighted acceptance rate, and rest
    periods. When speculating stops paying for a sequence (StepCost.best_k
    says k = 0 at its acceptance, or it is below the proposer's floor) it
    proposes nothing for a cool-down that doubles each time (4, 8, .. 64
    steps), then probes again as if new; a good step resets the cool-down.
    Keeps speculation from slowing down text it cannot predict."""

    # a new or rested sequence starts near break-even: one bad step sends it
    # back to rest, a good one lets k grow
    ewma: float = 0.8
    cooldown: int = 0
    backoff_steps: int = 4

    WEIGHT = 0.3
    MAX_BACKOFF_STEPS = 64

    def ready(self) -> bool:
        if self.cooldown > 0:
            self.cooldown -= 1
            return False
        return True

    def update(self, num_proposed: int, num_accepted: int) -> None:
        rate = num_accepted / num_proposed
        self.ewma += self.WEIGHT * (rate - self.ewma)
        if rate >= 0.5:
            self.backoff_steps = 4

    def rest(self, prior: float) -> None:
        """prior: the engine-wide acceptance rate. The step after the rest starts
        from it (capped at the default), so where nothing pays for anyone, the
        rests grow without probes; at the longest rest it probes regardless."""
        self.cooldown = self.backoff_steps
        longest = self.backoff_steps == self.MAX_BACKOFF_STEPS
        self.ewma = BackOff.ewma if longest else min(BackOff.ewma, prior)
        self.backoff_steps = min(2 * self.backoff_steps, self.MAX_BACKOFF_STEPS)


class StepCost:
    """Measured wall time of a step (proposing + forward) by the number of
    tokens it ran, for decode-only steps, and the choice of k it implies.

    With per-token acceptance rate a, k drafts emit E(k) = 1 + a + .. + a^k
    tokens in expectation; the step costs time(B + k) instead of time(B) for
    B decoding sequences. Speculating pays when E(k) / (time(B + k) / time(B))
    > 1, and the best k maximizes that ratio. On CPU a 5-token forward can cost
    2x a 1-token one (low-bit kernels scale with rows), so the break-even
    acceptance is far from 0 and must be measured, not assumed.
    """

    WEIGHT = 0.2
    MIN_GAIN = 1.02  # below this expected speedup a step is not worth the noise

    def __init__(self) -> None:
        self.time_s: dict[int, float] = {}

    def record(self, num_tokens: int, elapsed_s: float) -> None:
        prev = self.time_s.get(num_tokens)
        self.time_s[num_tokens] = elapsed_s if prev is None else prev + self.WEIGHT * (
            elapsed_s - prev)

    def relative(self, base_tokens: int, extra: int) -> float:
        """time(base + extra) / time(base); optimistic 1 + 0.1 * extra until measured,
        so that every k is tried once."""
        base = self.time_s.get(base_tokens)
        more = self.time_s.get(base_tokens + extra)
        if base is None or more is None:
            return 1.0 + 0.1 * extra
        return more / base

    def best_k(self, acceptance: float, base_tokens: int, max_k: int) -> int:
        best, best_gain, expected = 0, self.MIN_GAIN, 1.0
        for k in range(1, max_k + 1):
            expected += acceptance ** k
            gain = expected / self.relative(base_tokens, k)
            if gain > best_gain:
                best, best_gain = k, gain
        return best
