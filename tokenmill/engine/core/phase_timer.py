"""Wall time per step phase, summed into EngineStats.time_s."""

from __future__ import annotations

import time

STEP_PHASES = ("schedule", "prepare", "forward", "sample", "postprocess")


class PhaseTimer:
    """`with timer("forward"): ...` adds the block's wall time to totals["forward"].
    Under --async-scheduling the helper thread's phases (schedule, prepare,
    postprocess) overlap the forward, so the phases can sum to more than the wall time."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = totals
        self.phase = ""

    def __call__(self, phase: str) -> PhaseTimer:
        self.phase = phase
        return self

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.totals[self.phase] += time.perf_counter() - self.t0
