"""W5 shared prefix (PERFORMANCE.md): prefix caching on vs off, in one run.

64 requests sharing one 1,024-token system prompt, each with a distinct 64-token
suffix (exact token counts under the SmolLM2 tokenizer, seed 0), 64 output
tokens, ignore_eos, temperature 0, 16 in flight — the load llama-server was
measured under. The in-process engine is driven by `tokenmill bench`'s offline
target (same workload, schedule and metrics as the HTTP client, minus HTTP).
Metrics: TTFT p50/p99 and total time, caching on vs off; the ratio, and the
ratio to llama-server's recorded 74 s with its prompt cache (llama.cpp is not
installed here, so that figure is PERFORMANCE.md's, not re-run).

    .venv/bin/python benchmarks/shared_prefix.py
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import machine, median_spread

LLAMA_SERVER_CACHED_S = 74.0  # PERFORMANCE.md: -np 16 -c 32768, concurrency 16, prompt cache
LLAMA_SERVER_UNCACHED_S = 187.0


def run(caching: bool, args) -> dict:
    from tokenmill.bench.offline import OfflineTarget
    from tokenmill.bench.runner import BenchPlan, LoadSpec, run_once
    from tokenmill.bench.workload import BenchRequest, LengthSpec, WorkloadSpec, build_workload
    from tokenmill.config import CacheConfig, EngineConfig

    config = EngineConfig(model="smollm2-135m", max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          cache=CacheConfig(enable_prefix_caching=caching))
    target = OfflineTarget(config)
    # warm-up on an unrelated prompt, so that the shared prefix is not cached beforehand
    target.run([BenchRequest("Hello there, how are you?", None, 4)],
               LoadSpec(concurrency=1), np.random.default_rng(0), lambda r: None)
    spec = WorkloadSpec(dataset="prefix", input_len=LengthSpec.parse(args.suffix_len),
                        output_len=LengthSpec.parse(args.output_len), num_prefixes=1,
                        prefix_len=args.prefix_len)
    requests = build_workload(spec, args.num_requests, target.tokenizer, 0, 0)
    plan = BenchPlan(target=target, config={"model": "smollm2-135m"},
                     make_requests=lambda i: requests)
    result = run_once(plan, LoadSpec(concurrency=args.concurrency))
    s = result["summary"]
    assert s["num_completed"] == args.num_requests, result["notes"]
    engine = result.get("engine", {})
    print(f"  prefix caching {'on ' if caching else 'off'}: {s['duration_s']:.1f} s, "
          f"{s['output_throughput_tok_s']:.1f} output tok/s, TTFT p50 "
          f"{s['ttft_ms']['p50']:.0f} ms / p99 {s['ttft_ms']['p99']:.0f} ms; prefill tokens "
          f"run {engine.get('num_prefill_tokens', '?')}, mean decode batch "
          f"{engine.get('mean_decode_batch', 0):.1f}; engine time "
          + ", ".join(f"{k} {v:.1f}s" for k, v in engine.get("time_s", {}).items()))
    del target
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    args = ap.parse_args()
    print(f"W5 shared prefix · {machine()}")
    print(f"{args.num_requests} requests, {args.prefix_len}-token shared prefix + "
          f"{args.suffix_len}-token suffixes, {args.output_len} output tokens, concurrency "
          f"{args.concurrency}, {args.repeats} repeat(s)")
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.repeats):
        for caching in (True, False):
            runs[caching].append(run(caching, args))

    def med(caching: bool, key: str, sub: str | None = None) -> list[float]:
        return [s[key][sub] if sub else s[key] for s in runs[caching]]

    on_s, off_s = med(True, "duration_s"), med(False, "duration_s")
    on_ttft, off_ttft = med(True, "ttft_ms", "p50"), med(False, "ttft_ms", "p50")
    speedup = statistics.median(off_s) / statistics.median(on_s)
    print(f"total time: caching on {median_spread(on_s)} s, off {median_spread(off_s)} s "
          f"-> {speedup:.2f}x from prefix caching (target >= 3x: "
          f"{'met' if speedup >= 3 else 'missed'})")
    print(f"TTFT p50: caching on {median_spread(on_ttft)} ms, off {median_spread(off_ttft)} "
          f"ms -> {statistics.median(off_ttft) / statistics.median(on_ttft):.2f}x")
    vs_llama = LLAMA_SERVER_CACHED_S / statistics.median(on_s)
    print(f"llama-server (PERFORMANCE.md's recorded figures, not re-run: llama.cpp is not "
          f"installed here): {LLAMA_SERVER_CACHED_S:g} s with its prompt cache, "
          f"{LLAMA_SERVER_UNCACHED_S:g} s without; tokenmill with caching is {vs_llama:.2f}x "
          f"faster (target total <= {LLAMA_SERVER_CACHED_S / 3:.0f} s, i.e. >= 3x: "
          f"{'met' if vs_llama >= 3 else 'missed'})")


if __name__ == "__main__":
    main()
