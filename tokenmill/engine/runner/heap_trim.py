"""Hand the C heap's free pages back to the OS now and then (glibc's malloc_trim).

Why: every prefill step allocates activations of a new size (its token count),
and glibc's malloc raises its mmap threshold each time it frees a large mapped
block, so from then on those tensors come from the heap's arenas. The holes they
leave are reused only in part: under the soak's mixed lengths the engine's live
heap stayed flat (~860 MiB) while the arenas' free bytes grew by ~0.2 MiB a request,
and the engine core's RSS with them, ~20 MiB a minute (BENCHMARKS.md, "Soak").
`malloc_trim(0)` returns every whole free page inside the arenas (madvise), which
holds RSS flat without changing how anything is allocated.

The engine calls `after_step` after each step: it trims at most every
`interval_s` seconds while busy, and once when the engine goes idle.
`TOKENMILL_MALLOC_TRIM_S` sets the interval (0 turns trimming off). Where the C
library is not glibc there is nothing to call, and this does nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from tokenmill import malloc

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0
IDLE_MIN_GAP_S = 1.0  # a server idle between sparse requests trims at most this often
ENV = "TOKENMILL_MALLOC_TRIM_S"


def _malloc_trim() -> Callable[[int], bool] | None:
    return malloc.trim if malloc.trim_available() else None


def trim_heap() -> bool:
    """malloc_trim(0) once, now (after a load's temporaries are freed), unless trimming
    is off (TOKENMILL_MALLOC_TRIM_S=0) or the C library has none; True when it ran."""
    return interval_from_env() > 0 and malloc.trim()


def interval_from_env() -> float:
    raw = os.environ.get(ENV)
    if raw is None or not raw.strip():
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a number of seconds (0 turns trimming off), "
                         f"not {raw!r}") from None
    if value < 0:
        raise ValueError(f"{ENV} must be >= 0 (0 turns trimming off), not {raw!r}")
    return value


class HeapTrimmer:
    def __init__(self, interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_from_env() if interval_s is None else interval_s
        self._trim = _malloc_trim() if self.interval_s > 0 else None
        self._clock = clock
        self._last = clock()
        self.trims = 0

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    def after_step(self, busy: bool) -> bool:
        """After a step: trim if `interval_s` passed since the last trim, or if the
        engine is now idle and the last trim is IDLE_MIN_GAP_S old; True when it
        trimmed."""
        if self._trim is None:
            return False
        if self._clock() - self._last < (self.interval_s if busy else IDLE_MIN_GAP_S):
            return False
        self._trim(0)
        self._last = self._clock()
        self.trims += 1
        return True


MMAP_ENV = "TOKENMILL_MMAP_THRESHOLD"
DEFAULT_MMAP_THRESHOLD = 0  # dynamic: a fixed 256K cost ~4.5% CPU in page faults


def mmap_threshold_from_env() -> int:
    """TOKENMILL_MMAP_THRESHOLD: bytes (a K/M suffix allowed) from which an allocation
    gets its own mapping; 0 (the default) leaves glibc's dynamic threshold."""
    raw = os.environ.get(MMAP_ENV, "").strip()
    if not raw:
        return DEFAULT_MMAP_THRESHOLD
    scale = {"k": 1 << 10, "m": 1 << 20}.get(raw[-1].lower(), 1)
    try:
        value = int(raw[:-1] if scale > 1 else raw) * scale
    except ValueError:
        value = -1
    if not 0 <= value <= malloc.MMAP_THRESHOLD_MAX:
        raise ValueError(f"{MMAP_ENV} must be a size in bytes (e.g. 256K, 1M; at most "
                         f"32M) or 0 for glibc's dynamic threshold, not {raw!r}")
    return value


def fix_mmap_threshold() -> int:
    """Fix glibc's mmap threshold before the load, if TOKENMILL_MMAP_THRESHOLD asks
    (see the module's docstring): large, variably sized activations then get their own
    mappings and go back to the OS when freed, instead of leaving holes in the arenas
    that only a trim returns. Not the default: at 256K, a page fault per touched page of
    every large activation cost ~4.5% more CPU (system time 1.4 -> 10.6 s over 240
    mixed requests, 0.67M -> 6.1M minor faults, docs/memory.md), where the periodic
    trim already returns the holes. Returns the threshold set, 0 when left dynamic."""
    value = mmap_threshold_from_env()
    if value and malloc.set_mmap_threshold(value):
        logger.debug("glibc mmap threshold fixed at %d bytes", value)
        return value
    return 0
