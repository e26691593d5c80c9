"""Long-context serving (issue 22): bf16 vs 8-bit KV cache at the same --kv-cache-memory.

Offline through the engine (no HTTP): --num-requests prompts of --prompt-len random
token ids (seed 0), --output-len new tokens each with ignore_eos, all submitted at once
with --max-num-seqs = --concurrency, in a KV budget of --kv-cache-memory. Per KV dtype:
the blocks that budget holds, the largest concurrency whose sequences all fit at once
(blocks x block size / (prompt + output)), the median decode-only step time and its
batch, output tok/s over the run, and the preemptions the scheduler had to make.

    python -m benchmarks run long-context                  # 2,048 + 256, c=16 and 32
    python -m benchmarks run long-context --prompt-len 128 --output-len 16 \\
        --concurrency 4 --num-requests 4 --kv-cache-memory 8MiB  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def run(kv_dtype: str, concurrency: int, args) -> dict:
    from tokenmill.config import CacheConfig, EngineConfig
    from tokenmill.engine.core.llm_engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(
        model=args.model, max_num_seqs=concurrency,
        max_model_len=args.prompt_len + args.output_len,
        cache=CacheConfig(kv_cache_memory_bytes=args.kv_cache_memory,
                          enable_prefix_caching=False, kv_cache_dtype=kv_dtype)))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_requests):
        engine.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(args.prompt_len)],
                           params)
    decode_steps: list[tuple[float, int]] = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        before = engine.stats.num_prefill_tokens, engine.stats.num_decode_tokens
        s0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - s0
        if engine.stats.num_prefill_tokens == before[0]:  # a decode-only step
            decode_steps.append((dt, engine.stats.num_decode_tokens - before[1]))
    wall = time.perf_counter() - t0
    st = engine.get_stats()
    per_seq = args.prompt_len + args.output_len
    block_size = engine.config.cache.block_size
    fits = st.num_total_blocks // -(-per_seq // block_size)
    steps = sorted(decode_steps)
    out = {
        "kv_cache_dtype": kv_dtype, "concurrency": concurrency,
        "num_total_blocks": st.num_total_blocks, "max_concurrency_that_fits": fits,
        "median_decode_step_ms": 1e3 * statistics.median(d for d, _ in steps) if steps else None,
        "median_decode_batch": statistics.median(b for _, b in steps) if steps else None,
        "output_tok_s": args.num_requests * args.output_len / wall,
        "wall_s": wall, "num_preemptions": st.num_preemptions,
    }
    del engine
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--concurrency", default="16,32")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests per run (default: the concurrency)")
    ap.add_argument("--kv-cache-memory", default="1GiB",
                    help="the fixed KV budget both dtypes get")
    ap.add_argument("--kv-dtypes", default="bfloat16,int8")
    ap.add_argument("--output", help="write the rows as JSON")
    ap.add_argument("--no-result", action="store_true",
                    help="print only; write no benchmarks/results/ file")
    args = ap.parse_args(argv)

    from benchmarks.common import machine
    from tokenmill.cli.engine_args import parse_bytes

    args.kv_cache_memory = parse_bytes(args.kv_cache_memory)
    print(f"machine: {machine()}")
    print(f"{args.prompt_len}-token prompts, {args.output_len} output tokens, KV budget "
          f"{args.kv_cache_memory / 2**20:,.0f} MiB")
    rows = []
    fixed = args.num_requests
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        args.num_requests = fixed or concurrency
        for kv_dtype in args.kv_dtypes.split(","):
            row = run(kv_dtype, concurrency, args)
            rows.append(row)
            step = row["median_decode_step_ms"]
            print(f"c={concurrency:>3} KV {kv_dtype:>9}: {row['num_total_blocks']:,} blocks, "
                  f"fits {row['max_concurrency_that_fits']} sequences; decode step "
                  f"{'n/a' if step is None else f'{step:.1f} ms'} at batch "
                  f"{row['median_decode_batch']}; {row['output_tok_s']:.1f} output tok/s; "
                  f"{row['num_preemptions']} preemptions")
    if args.output:
        Path(args.output).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2))
    if not args.no_result:
        from benchmarks import results
        from benchmarks.results import Figure

        cfg = {"model": args.model, "prompt": args.prompt_len, "output_len": args.output_len,
               "kv_cache_memory_mib": args.kv_cache_memory // 2**20}
        figures = [Figure(f"KV {r['kv_cache_dtype']}, c={r['concurrency']}", "tokenmill",
                          f"output throughput c={r['concurrency']}", "tok/s",
                          [r["output_tok_s"]], True,
                          {**cfg, "kv_cache_dtype": r["kv_cache_dtype"],
                           "blocks": r["num_total_blocks"],
                           "preemptions": r["num_preemptions"]}) for r in rows]
        results.write(results.build("long-context", "Long context: bf16 vs 8-bit KV cache",
                                    figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
