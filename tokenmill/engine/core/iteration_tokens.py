"""Tokens run per engine step as a cumulative histogram, for vLLM's
`iteration_tokens_total` metric: plain counts, so the stats snapshot that
crosses from the engine core to the server stays a small picklable value."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# vLLM's buckets for iteration_tokens_total
BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class IterationTokens:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))  # last: +Inf
    total: int = 0  # sum of the observed token counts

    def observe(self, num_tokens: int) -> None:
        self.counts[bisect.bisect_left(BUCKETS, num_tokens)] += 1
        self.total += num_tokens

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count of steps with at most that many tokens), as Prometheus buckets."""
        out, running = [], 0
        for bound, count in zip([*map(str, map(float, BUCKETS)), "+Inf"], self.counts):
            running += count
            out.append((bound, running))
        return out

    def as_dict(self) -> dict:
        return {"buckets": list(BUCKETS), "counts": list(self.counts), "total": self.total}
