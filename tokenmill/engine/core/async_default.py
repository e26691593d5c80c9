"""Whether the engine schedules step N+1 while step N computes (OverlapStepper).

On by default with CUDA, as vLLM's is: there the host's scheduling and input
preparation are a large share of a decode step (the H200 run, BENCHMARKS.md
2026-12-04: batch-1 decode at 59.7-67.7% of bandwidth synchronous, 75.3% async).
Off by default on a CPU: the host and the "device" are the same cores, so there is
nothing to overlap. An explicit --async-scheduling / --no-async-scheduling wins.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def resolve_async_scheduling(requested: bool | None, device_type: str,
                             tensor_parallel_size: int = 1,
                             speculative: str | None = None) -> bool:
    """`requested` None: on for device_type "cuda" unless something that needs the
    host's tokens every step (speculative decoding) or tensor parallelism runs."""
    if requested is not None:
        return requested
    on = device_type == "cuda" and tensor_parallel_size == 1 and speculative is None
    logger.info("async scheduling: %s (default: on with CUDA, off on CPU; device %s%s)",
                "on" if on else "off", device_type,
                "" if on or device_type != "cuda" else ", off with tensor parallelism or "
                "speculative decoding")
    return on
