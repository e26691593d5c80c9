"""What adjacent KV blocks buy decode attention on a CPU, and what the block manager's
adjacent allocation buys long-context decode steps.

1. Kernel: decode attention (paged_decode.c) over the same 30 layers' pools through three
   block tables per row: blocks shuffled over the pool, runs of 4 adjacent blocks
   shuffled, and each row's blocks adjacent. Alternated round by round; medians.
2. Engine: two engines in one process, each with a pool of `--pool-blocks` blocks and
   prefix caching on (the default). Each first serves `--churn` requests (prompts of
   32-512 random ids, 16-64 new tokens), enough to run through its pool, so that fresh
   blocks come from the prefix cache's LRU; then `--rows` requests of `--context` random
   ids decode `--new-tokens` tokens. Engine "as before" takes each fresh block as the
   block manager did until this change (the last freed, else the LRU's least recently
   freed, in that order, nothing held back); engine "adjacent" runs BlockManager as
   it is. The long requests' decode steps are alternated between the two engines, step
   by step; the share of adjacent block pairs in the tables they read is printed.

    python -m benchmarks run kv-adjacency
    python -m benchmarks run kv-adjacency --skip-engine --rows 16 --context 4096
    # long generations on a fresh pool (no churn): decode growth is what scatters
    python -m benchmarks run kv-adjacency --skip-kernel --churn 0 --context 128 \
        --new-tokens 1024
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time

import torch

from benchmarks.common import machine


def kernel_part(rows: int, context: int, layers: int, rounds: int) -> None:
    from tokenmill.kernels import paged_decode

    heads, kv_heads, dim, bs = 9, 3, 64, 16
    own = -(-context // bs)
    num_blocks = rows * own + 8
    rng = random.Random(0)
    order = list(range(num_blocks))
    rng.shuffle(order)
    runs = [list(range(i, min(i + 4, num_blocks))) for i in range(0, num_blocks, 4)]
    rng.shuffle(runs)
    in_runs = [b for run in runs for b in run]
    tables = {
        "shuffled": order,
        "runs of 4": in_runs,
        "adjacent": list(range(num_blocks)),
    }
    tables = {name: torch.tensor([t[r * own:(r + 1) * own] for r in range(rows)],
                                 dtype=torch.int32) for name, t in tables.items()}
    lens = torch.full((rows,), context, dtype=torch.int32)
    pools = [(torch.randn(kv_heads, num_blocks, bs, dim).to(torch.bfloat16),
              torch.randn(kv_heads, num_blocks, bs, dim).to(torch.bfloat16))
             for _ in range(layers)]
    q = torch.randn(rows, heads, dim).to(torch.bfloat16)
    scratch = torch.empty(rows * heads * context * 2, dtype=torch.float32)
    times: dict[str, list[float]] = {name: [] for name in tables}
    for _ in range(rounds):
        for name, table in tables.items():
            t0 = time.perf_counter()
            for k, v in pools:
                if paged_decode.paged_decode(q, k, v, table, 0, lens, context, dim ** -0.5,
                                             scratch)[0] is None:
                    sys.exit("the decode kernel did not take these inputs")
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["shuffled"])
    print(f"decode attention, {rows} rows x {context} tokens, {layers} layers, "
          f"{rounds} rounds:")
    for name, t in times.items():
        print(f"  {name:>10}: median {statistics.median(t) * 1e3:7.2f} ms, min "
              f"{min(t) * 1e3:7.2f}; shuffled / this {base / statistics.median(t):.3f}")


def adjacency(tables: list[list[int]]) -> float:
    pairs = sum(len(t) - 1 for t in tables)
    return sum(b == a + 1 for t in tables for a, b in itertools.pairwise(t)) / max(1, pairs)


def engine_part(args: argparse.Namespace) -> None:
    from tokenmill import LLM, SamplingParams

    engines = {}
    for name in ("as before", "adjacent"):
        llm = LLM("smollm2-135m", max_num_seqs=256, num_kv_blocks=args.pool_blocks)
        bm = llm.engine.block_manager
        if name == "as before":  # each block as it comes: the last freed, else the LRU's
            bm._take_fresh_run = lambda n, after, bm=bm: [
                bm._take_fresh_block() for _ in range(n)]
            bm._hold_back = lambda start, n: None
        rng = random.Random(1)
        churn = [[rng.randrange(100, 49000) for _ in range(rng.randint(32, 512))]
                 for _ in range(args.churn)]
        params = [SamplingParams(temperature=0, max_tokens=rng.randint(16, 64), ignore_eos=True)
                  for _ in churn]
        t0 = time.perf_counter()
        if churn:
            llm.generate(churn, params, use_tqdm=False)
        print(f"  {name}: churned {args.churn} requests in {time.perf_counter() - t0:.0f} s; "
              f"{bm.num_touched_blocks} of {bm.num_total_blocks} blocks touched")
        engines[name] = llm.engine
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 49000) for _ in range(args.context)] for _ in range(args.rows)]
    for eng in engines.values():
        for i, ids in enumerate(prompts):
            eng.add_request(f"long-{i}", ids, SamplingParams(
                temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
    times: dict[str, list[float]] = {name: [] for name in engines}
    tables: dict[str, list[list[int]]] = {name: [] for name in engines}
    while any(eng.has_unfinished_requests() for eng in engines.values()):
        for name, eng in engines.items():
            if not eng.has_unfinished_requests():
                continue
            held = [list(s.block_table) for s in eng.scheduler.running]
            t0 = time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - t0
            if len(outs) == args.rows and all(len(o.outputs[0].token_ids) > 1 for o in outs):
                times[name].append(dt)  # a decode step of every row
                tables[name] = held  # the tables it read (its last step frees them)
    print(f"engine decode steps, {args.rows} rows x {args.context}-token prompts, "
          f"{args.new_tokens} new tokens, after the churn (alternated step by step):")
    for name, t in times.items():
        print(f"  {name:>9}: median {statistics.median(t) * 1e3:7.2f} ms, min "
              f"{min(t) * 1e3:7.2f} ({len(t)} steps); adjacent block pairs "
              f"{adjacency(tables[name]):.1%}")
    ratio = statistics.median(times["as before"]) / statistics.median(times["adjacent"])
    print(f"as before / adjacent: {ratio:.3f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30, help="kernel part")
    ap.add_argument("--rounds", type=int, default=9, help="kernel part")
    ap.add_argument("--new-tokens", type=int, default=48, help="engine part")
    ap.add_argument("--pool-blocks", type=int, default=2400, help="engine part")
    ap.add_argument("--churn", type=int, default=160, help="engine part")
    ap.add_argument("--skip-kernel", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args(argv)
    if args.rows * -(-(args.context + args.new_tokens) // 16) > args.pool_blocks:
        ap.error("--pool-blocks must hold --rows x (--context + --new-tokens) tokens")
    print(f"KV block adjacency · {machine()}")
    if not args.skip_kernel:
        kernel_part(args.rows, args.context, args.layers, args.rounds)
    if not args.skip_engine:
        engine_part(args)


if __name__ == "__main__":
    main()
