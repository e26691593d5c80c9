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

--engine runs W5 end to end on one in-process engine instead (64 requests sharing a
1,024-token prefix of random ids, seed 0, 64-token suffixes, 64 output tokens,
ignore_eos, greedy, 16 in flight), the paths toggled between runs in alternating
order; there `cascade` also sends the suffix prefills through the cascade call, and
`merge` / `unshared` leave them to SDPA.

    python -m benchmarks run cascade-decode
    python -m benchmarks run cascade-decode --sweep-blocks 1,2,3,4,6,8 --own-max 16
    python -m benchmarks run cascade-decode --engine --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks.common import machine
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


def set_path(path: str) -> None:
    """The engine-wide switches for `path` (thresholds back to the measured ones)."""
    cpu.CASCADE_NATIVE = path != "merge"
    unshared = path == "unshared"
    cpu.MIN_CASCADE_BLOCKS = 1 << 30 if unshared else 8
    cpu.MIN_SHARED_BLOCKS = 1 << 30 if unshared else 4


def engine_ab(args) -> int:
    """W5 on one in-process engine, each path once per round, alternating order."""
    from tokenmill import LLM, SamplingParams

    engine = LLM("smollm2-135m").engine
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(args.prefix_tokens)]
    prompts = [prefix + [rng.randrange(100, 40000) for _ in range(64)]
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)

    def run(tag: str, n: int) -> float:
        t0 = time.perf_counter()
        sent, in_flight = 0, set()
        while sent < n or engine.has_unfinished_requests():
            while sent < n and len(in_flight) < 16:
                engine.add_request(f"{tag}-{sent}", prompts[sent], params)
                in_flight.add(f"{tag}-{sent}")
                sent += 1
            for out in engine.step():
                if out.finished:
                    in_flight.discard(out.request_id)
        return time.perf_counter() - t0

    paths = ["cascade", "merge", "unshared"]
    set_path(paths[0])
    run("warm-up", min(16, args.requests))  # caches the prefix, builds the kernels
    times: dict[str, list[float]] = {p: [] for p in paths}
    for r in range(args.rounds):
        for p in paths if r % 2 == 0 else paths[::-1]:
            set_path(p)
            times[p].append(run(f"{p}{r}", args.requests))
            print(f"round {r}: {p} {times[p][-1]:.2f} s", flush=True)
    set_path("cascade")
    for p, t in times.items():
        med = statistics.median(t)
        print(f"{p:>9}: median {med:.2f} s (range {min(t):.2f}-{max(t):.2f}), "
              f"{med / statistics.median(times['cascade']):.2f}x cascade's")
    return 0


def main(argv: list[str] | None = None) -> int:
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
    ap.add_argument("--engine", action="store_true", help="W5 end to end instead")
    ap.add_argument("--requests", type=int, default=64, help="--engine: requests per run")
    ap.add_argument("--output-tokens", type=int, default=64, help="--engine: tokens each")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.engine and cpu.native.available():
        print(f"machine: {machine()}; torch threads {torch.get_num_threads()}; W5 in-process: "
              f"{args.requests} requests, {args.prefix_tokens}-token shared prefix, 64-token "
              f"suffixes, {args.output_tokens} output tokens, 16 in flight, "
              f"{args.rounds} rounds")
        return engine_ab(args)
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
