"""Start-up phases of `tokenmill serve`, timed from the exec of the process
(its start time in /proc/self/stat) and logged at debug: what the front end
and the engine core spend before the first /health 200. Plain Python, no
imports beyond the standard library, so importing it costs nothing.

Read with `tokenmill serve --log-level debug 2>&1 | grep start-up`; the core's
lines carry `[core]` and its own clock (it is a process of its own, exec'd
after the front end's "engine core spawned").
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger("tokenmill.startup")
_last_s: float | None = None
_last_cpu_s = 0.0


def since_exec_s() -> float:
    """Seconds since this process was exec'd (Linux); since the first call elsewhere."""
    global _exec_at
    if _exec_at is None:
        try:
            with open("/proc/self/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            _exec_at = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # boot clock, 10 ms ticks
        except (OSError, ValueError, IndexError):
            _exec_at = _now()
    return _now() - _exec_at


def _now() -> float:
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock) if clock is not None else time.monotonic()


_exec_at: float | None = None


def mark(phase: str) -> None:
    """Log that `phase` has just ended: when, how long since the previous mark, and the
    CPU seconds (user + system, all threads) this process spent on it: on a loaded
    machine the wall times stretch, the CPU seconds hold."""
    global _last_s, _last_cpu_s
    now = since_exec_s()
    took = now - (_last_s or 0.0)
    cpu = time.process_time()
    _last_s, cpu_took, _last_cpu_s = now, cpu - _last_cpu_s, cpu
    logger.debug("start-up: %-44s done at %6.3f s (%.3f s; cpu %.3f s)", phase, now, took,
                 cpu_took)


# what the server's front end must not load on its way to /health (issue 60)
HEAVY_MODULES = ("torch", "transformers", "xgrammar")


def log_heavy_modules() -> None:
    """Log which of HEAVY_MODULES this process has imported so far (a line that
    tests and `benchmarks/startup.py` read: "start-up modules: torch=no ...")."""
    import sys

    found = " ".join(f"{name}={'yes' if name in sys.modules else 'no'}"
                     for name in HEAVY_MODULES)
    logger.debug("start-up modules: %s", found)
