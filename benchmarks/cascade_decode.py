"""Shared-prefix (cascade) decode attention (issue 21, W5): the CPU backend's decode
paths A/B on one layer's call, in one process.

W5's decode shape by default: 16 sequences, SmolLM2-135M's heads (9 query / 3 kv,
head_dim 64), a --prefix-tokens shared prefix (one block table prefix, as a
prefix-cache hit gives) and 64..128 own tokens each, the engine's block size 16,
bf16 pools, the prefix's blocks consecutive and the rest shuffled. Paths, each run once per round in turn (on a
busy machine read the paired ratios, not the absolute times):

- cascade: one native call (tm_cascade_decode_bf16): the shared blocks read once
  for all queries, each sequence's own blocks, the merge;
- merge: the native kernel over the own blocks, the shared part by a torch matmul
  and the merge in torch ops (TOKENMILL_CASCADE_NATIVE=0);
- unshared: the native kernel over every sequence's whole table (what a batch
  below MIN_CASCADE_BLOCKS shared blocks or MIN_CASCADE_SEQS sequences gets).

--sweep-blocks 1,2,4,8 times cascade against unshared at those shared-prefix
lengths instead (where MIN_CASCADE_BLOCKS should sit; --seqs for MIN_CASCADE_SEQS).

    .venv/bin/python benchmarks/cascade_decode.py
    .venv/bin/python benchmarks/cascade_decode.py --sweep-blocks 1,2,3,4,6,8 --own-tokens 16
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import machine

from tokenmill.attention import cpu
from tokenmill.attention.torch_ref import kv_cache_shape


def batch(num_seqs: int, prefix_blocks: int, own_tokens: tuple[int, int], block_size: int,
          heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    rng = random.Random(seed)
    own = [rng.randint(*own_tokens) for _ in range(num_seqs)]
    need = prefix_blocks + sum(-(-n // block_size) for n in own)
    prefix = list(range(prefix_blocks))  # consecutive, as a fresh pool hands them out
    free = list(range(prefix_blocks, need + 8))
    rng.shuffle(free)
    tables = [prefix + [free.pop() for _ in range(-(-n // block_size))] for n in own]
    width = max(len(t) for t in tables)
    gen = torch.Generator().manual_seed(seed)
    shape = kv_cache_shape(len(free) + need, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    q = torch.randn(num_seqs, heads, head_dim, generator=gen).bfloat16()
    seq_lens = [prefix_blocks * block_size + n for n in own]
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, seq_lens


def make_plan(path: str, tables, seq_lens, k_cache) -> cpu._DecodePlan:
    """The plan that takes `path`, whatever the thresholds say."""
    saved = cpu.MIN_SHARED_BLOCKS, cpu.MIN_CASCADE_BLOCKS, cpu.MIN_CASCADE_SEQS
    least = 1 << 30 if path == "unshared" else 1
    cpu.MIN_SHARED_BLOCKS = cpu.MIN_CASCADE_BLOCKS = cpu.MIN_CASCADE_SEQS = least
    try:
        return cpu._DecodePlan(tables, seq_lens, k_cache)
    finally:
        cpu.MIN_SHARED_BLOCKS, cpu.MIN_CASCADE_BLOCKS, cpu.MIN_CASCADE_SEQS = saved


def time_paths(paths: list[str], args, prefix_blocks: int) -> dict[str, float]:
    """Median microseconds per call of each path, rounds interleaved."""
    q, k_cache, v_cache, tables, seq_lens = batch(
        args.seqs, prefix_blocks, (args.own_min, args.own_max), args.block_size, args.heads,
        args.kv_heads, args.head_dim)
    scale = args.head_dim ** -0.5
    plans = {p: make_plan(p, tables, seq_lens, k_cache) for p in paths}
    outs = {}
    times: dict[str, list[float]] = {p: [] for p in paths}
    for r in range(args.rounds + 1):
        for p in paths:
            cpu.CASCADE_NATIVE = p == "cascade"
            t0 = time.perf_counter()
            for _ in range(args.calls):
                out = cpu._decode_batch(q, k_cache, v_cache, plans[p], scale)
            if r:  # the first round warms up
                times[p].append(1e6 * (time.perf_counter() - t0) / args.calls)
            outs[p] = out.float()
    cpu.CASCADE_NATIVE = True
    base = outs[paths[0]]
    for p in paths[1:]:
        diff = (outs[p] - base).abs().max().item()
        assert diff < 5e-2, f"{p} differs from {paths[0]} by {diff}"
    return {p: statistics.median(t) for p, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--own-min", type=int, default=64)
    ap.add_argument("--own-max", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10, help="calls per path per round")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--sweep-blocks", default="", help="shared-prefix lengths in blocks")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"machine: {machine()}; torch threads {torch.get_num_threads()}; {args.seqs} seqs, "
          f"{args.heads}/{args.kv_heads} heads x {args.head_dim}, block size "
          f"{args.block_size}, own tokens {args.own_min}..{args.own_max}, "
          f"{args.rounds} rounds x {args.calls} calls (medians, us per layer call)")
    if not cpu.native.available():
        print("native kernel not built here: nothing to compare")
        return 1
    if args.sweep_blocks:
        print(f"{'shared blocks':>13} {'cascade':>9} {'unshared':>9} {'ratio':>6}")
        for blocks in [int(b) for b in args.sweep_blocks.split(",")]:
            t = time_paths(["cascade", "unshared"], args, blocks)
            print(f"{blocks:>13} {t['cascade']:>9.1f} {t['unshared']:>9.1f} "
                  f"{t['unshared'] / t['cascade']:>6.2f}")
        return 0
    blocks = args.prefix_tokens // args.block_size
    t = time_paths(["cascade", "merge", "unshared"], args, blocks)
    for p, us in t.items():
        print(f"{p:>9}: {us:9.1f} us  ({us / t['cascade']:.2f}x cascade's)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
