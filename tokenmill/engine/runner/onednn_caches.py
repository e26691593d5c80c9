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
caches at ~130-250 MiB at SmolLM2's shapes (docs/memory.md).
"""

from __future__ import annotations

import os

DEFAULT_CAPACITY = 128
ENV_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = DEFAULT_CAPACITY) -> dict[str, str]:
    """Set each cache's capacity unless the environment already has one; returns
    the values in effect."""
    for name in ENV_VARS:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in ENV_VARS}
