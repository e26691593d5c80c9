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
engine compiles them while it starts (`precompile_packed`): load then adds no code
(without it a soak saw RSS climb each time traffic first reached a bucket, late in a
long run as often as early) and no request waits for a compile.
"""

from __future__ import annotations

import os

import torch

from tokenmill.quant.dense import DenseWeight, bucket_rows

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


@torch.inference_mode()
def precompile_packed(model: torch.nn.Module, max_rows: int, max_head_rows: int
                      ) -> tuple[int, str]:
    """Compile, at start-up, every primitive the packed matmuls can need, when they all
    fit the caches: a server's RSS then holds its oneDNN code from the start instead of
    growing by ~0.7 MiB each time load first reaches a new bucket (the soak read
    that as a leak), and no request pays a compile. Returns (primitives compiled, why
    none were: "" when compiled)."""
    shapes = packed_shapes(model, max_rows, max_head_rows)
    total = sum(len(rows) for _, rows in shapes.values())
    capacity = capacity_in_effect()
    if not shapes:
        return 0, "no packed large-batch linears"
    if total > capacity:
        return 0, (f"{total} shapes at up to {max_rows} tokens a step would not fit the "
                   f"caches' {capacity} entries")
    for dense, rows in shapes.values():
        for m in rows:
            dense(torch.zeros(m, dense.in_features, dtype=dense.dtype))
    return total, ""
