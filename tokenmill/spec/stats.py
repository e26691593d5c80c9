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
    """Per sequence: an exponentially weighted acceptance rate; when it drops
    below the proposer's threshold the sequence proposes nothing for a
    cool-down that doubles each time (4, 8, .. 64 steps) and resets once
    proposals pay again. Keeps speculation from slowing down text it cannot
    predict."""

    ewma: float = 1.0
    cooldown: int = 0
    backoff_steps: int = 4

    WEIGHT = 0.3
    MAX_BACKOFF_STEPS = 64

    def ready(self) -> bool:
        if self.cooldown > 0:
            self.cooldown -= 1
            return False
        return True

    def update(self, num_proposed: int, num_accepted: int, threshold: float) -> None:
        rate = num_accepted / num_proposed
        self.ewma += self.WEIGHT * (rate - self.ewma)
        if self.ewma < threshold:
            self.cooldown = self.backoff_steps
            self.backoff_steps = min(2 * self.backoff_steps, self.MAX_BACKOFF_STEPS)
            self.ewma = 2 * threshold  # a fresh probe after the cool-down
        elif rate >= 2 * threshold:
            self.backoff_steps = 4
