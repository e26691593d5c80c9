"""Bound oneDNN's per-shape caches, the engine's heap growth under mixed lengths.

Every large-batch bf16 linear (the float copy's packed weights, `mkldnn_linear`) is a
oneDNN primitive compiled for its exact shape, and a step's shape is its token count,
so a server sees a new shape for almost every prefill. Each primitive holds JIT code
of its own: ~1.7-2.3 MiB for SmolLM2's projections (memray, 2026-12-06: 110 of the
114 MiB the engine kept from 96 mixed requests were brgemm kernels' code pages,
their descriptors, and ideep's cached primitive descriptors). oneDNN keeps up to
1,024 primitives (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and torch's ideep another 1,024
(LRU_CACHE_CAPACITY), each entry keeping its primitive alive: bounded only after
some GiB, and live memory, so `malloc_trim` cannot return it.

Both are read by the libraries once, at their first primitive, so the engine sets
them before its load (a process that ran a oneDNN matmul before it keeps whatever it
had). A value the user exported wins. A shape evicted and seen again is compiled
again: ~0.5-1.5 ms a projection shape. The packed matmuls run at bucketed row counts
(quant/dense.py `bucket_rows`), so a server's steps (256 tokens at most by default)
use 18 row counts x ~5 projection shapes: 128 entries hold them all, and bound the
caches at ~130-250 MiB at SmolLM2's shapes (docs/memory.md). Where they all fit, the
engine compiles them all (`PackedPrecompile`): load then adds no code (without it a
soak saw RSS climb each time traffic first reached a bucket, late in a long run as
often as early) and no request waits for a compile. The offline engine compiles them
before its first step; a server on a background thread once it answers (at start-up
it was 0.73-0.94 s of a 4.33-4.65 s start on the 2-core machine, docs/startup.md).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch

from tokenmill.quant.dense import DenseWeight, bucket_rows

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 128
ENV_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = DEFAULT_CAPACITY) -> dict[str, str]:
    """Set each cache's capacity unless the environment already has one; returns
    the values in effect."""
    for name in ENV_VARS:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in ENV_VARS}


def capacity_in_effect() -> int:
    """The smaller of the two caches' capacities as the environment sets them now."""
    values = []
    for name in ENV_VARS:
        try:
            values.append(int(os.environ.get(name, DEFAULT_CAPACITY)))
        except ValueError:
            values.append(DEFAULT_CAPACITY)
    return min(values)


def packed_shapes(model: torch.nn.Module, max_rows: int, max_head_rows: int
                  ) -> dict[tuple[int, int, torch.dtype], tuple[DenseWeight, list[int]]]:
    """Each packed weight shape the model's linears run, with the bucketed row counts a
    step of at most `max_rows` tokens (an LM head: `max_head_rows` logit rows) can give
    it, from the linear's `dense_min_rows` on."""
    found: dict[tuple[int, int, torch.dtype], tuple[DenseWeight, set[int]]] = {}
    buckets: dict[tuple[int, int], set[int]] = {}  # (first, last row) -> its buckets
    for name, module in model.named_modules():
        dense = getattr(module, "dense", None)
        if not isinstance(dense, DenseWeight) or dense.packed is None:
            continue
        span = (module.dense_min_rows or 1,
                max_head_rows if name.endswith("lm_head") else max_rows)
        if span not in buckets:
            buckets[span] = {bucket_rows(m) for m in range(span[0], span[1] + 1)}
        key = (dense.in_features, dense.out_features, dense.dtype)
        # one weight per shape compiles for all of them: the union of their row counts
        found.setdefault(key, (dense, set()))[1].update(buckets[span])
    shapes = {key: (dense, sorted(rows)) for key, (dense, rows) in found.items()}
    return shapes


class PackedPrecompile:
    """The compile of every primitive the packed matmuls can need, when they all fit the
    caches: `run` compiles on the calling thread, `start` on a background thread. Its
    state ("pending", "running", "done", "skipped" or "failed") is on /server_info
    (`describe`); an exception is logged and leaves the shapes to compile at first use."""

    def __init__(self, shapes: dict[Any, tuple[DenseWeight, list[int]]], why_not: str = ""
                 ) -> None:
        self.shapes = {} if why_not else shapes
        self.num_shapes = sum(len(rows) for _, rows in self.shapes.values())
        self.why_not = why_not  # why it is skipped, or why it failed
        self.state = "skipped" if why_not else "pending"
        self.seconds: float | None = None
        self._lock = threading.Lock()  # state, seconds and why_not change together
        self._finished = threading.Event()
        if why_not:
            self._finished.set()

    @classmethod
    def plan(cls, model: torch.nn.Module, max_rows: int, max_head_rows: int
             ) -> PackedPrecompile:
        """What a step of at most `max_rows` tokens (`max_head_rows` logit rows) can
        compile; skipped where it would not all fit the caches (it would evict itself)."""
        shapes = packed_shapes(model, max_rows, max_head_rows)
        total = sum(len(rows) for _, rows in shapes.values())
        capacity = capacity_in_effect()
        why_not = ""
        if not shapes:
            why_not = "no packed large-batch linears"
        elif total > capacity:
            why_not = (f"{total} shapes at up to {max_rows} tokens a step would not fit the "
                       f"caches' {capacity} entries")
        return cls(shapes, why_not)

    def run(self) -> None:
        """Compile now, on this thread (the offline engine, before its first step)."""
        if self._claim():
            self._compile("at start-up")

    def start(self) -> None:
        """Compile on a background thread (a server, once it answers), at this thread's
        intra-op thread count: the count is part of oneDNN's cache key, so the steps this
        thread runs find every primitive (ideep's cache is per thread, but oneDNN's, which
        holds the compiled code, is the process's and thread-safe; the packed weights are
        only read). Until it is done the compile shares the cores with the first steps."""
        if not self._claim():
            return
        threads = torch.get_num_threads()
        threading.Thread(target=self._compile, args=("in the background", threads),
                         name="tokenmill-onednn-precompile", daemon=True).start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether it has finished (done, skipped or failed), waiting up to timeout_s."""
        return self._finished.wait(timeout_s)

    def describe(self) -> dict[str, Any]:
        """For /server_info: {"state", "shapes", "seconds", "why"}."""
        with self._lock:
            return {"state": self.state, "shapes": self.num_shapes,
                    "seconds": None if self.seconds is None else round(self.seconds, 3),
                    "why": self.why_not or None}

    def _claim(self) -> bool:
        with self._lock:
            if self.state != "pending":
                return False
            self.state = "running"
            return True

    def _compile(self, where: str, threads: int | None = None) -> None:
        started = time.perf_counter()
        try:
            if threads is not None:
                torch.set_num_threads(threads)  # this thread's OpenMP count (the same value)
            with torch.inference_mode():
                for dense, rows in self.shapes.values():
                    for m in rows:
                        dense(torch.zeros(m, dense.in_features, dtype=dense.dtype))
        except Exception as e:  # never the engine's end: the shapes compile at first use
            logger.exception("packed matmuls: the oneDNN compile %s failed; they compile "
                             "at first use", where)
            self._finish("failed", time.perf_counter() - started, f"{type(e).__name__}: {e}")
            return
        seconds = time.perf_counter() - started
        # every rank says it (a worker's line carries its rank); before "done", so that
        # whoever sees "done" finds the line
        logger.info("packed matmuls: %d oneDNN shapes compiled %s (%.2f s)", self.num_shapes,
                    where, seconds)
        self._finish("done", seconds)

    def _finish(self, state: str, seconds: float, why: str = "") -> None:
        with self._lock:
            self.state, self.seconds, self.why_not = state, seconds, why
        self._finished.set()
