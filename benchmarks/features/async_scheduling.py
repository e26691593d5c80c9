"""--async-scheduling on and off, same process, same engine: W3-style batch-1
decode and batch-16 decode.

One engine (the default weights unless --dtype/--quantization say otherwise);
each repeat runs every workload with synchronous steps, then with the overlapped
stepper (engine/overlap.py) swapped in, so both see the same weights, caches and
machine load. Workloads: batch B, a --prompt-len-token prompt of random ids per
request (seed 0), --new-tokens new tokens, ignore_eos, greedy. Per run: TPOT
(time per output token after the first, mean over requests), decode tok/s
(B x 1000 / TPOT) and engine step time (wall time / steps). Medians of
--repeats, with the on/off tok/s ratio (off TPOT / on TPOT), and batch 1 against its floor (weight + KV
bytes read per step / PERFORMANCE.md's quiet-machine bandwidth).

    python -m benchmarks run async-scheduling                   # W3 sizes
    python -m benchmarks run async-scheduling --new-tokens 16 --repeats 1  # smoke
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks import results as results_mod
from benchmarks.common import machine
from benchmarks.floors import decode_floor_ms, roofline_dtype
from benchmarks.results import Figure
from tokenmill.config import CacheConfig
from tokenmill.engine.core.llm_engine import LLMEngine
from tokenmill.engine.core.overlap import OverlapStepper
from tokenmill.sampling_params import SamplingParams


def run_once(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    steps_before = engine.stats.num_steps
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    wall_s = time.perf_counter() - t0
    steps = engine.stats.num_steps - steps_before
    tpots = []
    for out in done.values():
        m = out.metrics
        assert len(out.outputs[0].token_ids) == new_tokens
        tpots.append(1e3 * (m.finished_time - m.first_token_time) / (new_tokens - 1))
    return {"tpot_ms": statistics.mean(tpots), "step_ms": 1e3 * wall_s / max(steps, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--no-floor", action="store_true", help="skip the roofline subprocess")
    ap.add_argument("--no-result", action="store_true",
                    help="print only; write no benchmarks/results/ file")
    args = ap.parse_args(argv)

    rng = random.Random(0)
    engine = LLMEngine(model="smollm2-135m", dtype=args.dtype, quantization=args.quantization,
                       max_num_seqs=max(args.batches),
                       cache=CacheConfig(enable_prefix_caching=False))  # runs compute prompts
    overlapped = OverlapStepper(engine)
    workloads = {b: [[rng.randrange(100, 49000) for _ in range(args.prompt_len)]
                     for _ in range(b)] for b in args.batches}
    run_once(engine, workloads[args.batches[0]], 8)  # warm-up
    results: dict[tuple[int, str], list[dict]] = {}
    for _ in range(args.repeats):
        for b, prompts in workloads.items():
            for mode, stepper in (("off", None), ("on", overlapped)):
                engine.overlap = stepper
                results.setdefault((b, mode), []).append(run_once(engine, prompts,
                                                                  args.new_tokens))
    engine.overlap = None
    overlapped.close()

    print(f"# async scheduling A/B, {machine()}")
    print(f"# prompt {args.prompt_len} tokens, {args.new_tokens} new, greedy, "
          f"medians of {args.repeats}; one engine, modes interleaved")
    floor = None
    if 1 in args.batches and not args.no_floor:
        floor = decode_floor_ms(roofline_dtype(engine.quantization, str(engine.dtype)),
                                args.prompt_len, args.new_tokens)
    print(f"{'batch':>5} {'async':>5} {'TPOT ms':>8} {'tok/s':>8} {'step ms':>8} "
          f"{'on/off tok/s':>12}")
    for b in args.batches:
        med = {mode: {k: statistics.median(r[k] for r in results[(b, mode)])
                      for k in ("tpot_ms", "step_ms")} for mode in ("off", "on")}
        for mode in ("off", "on"):
            m = med[mode]
            m["tok_s"] = b * 1e3 / m["tpot_ms"]  # decode tok/s of the median TPOT
            ratio = f"{med['off']['tpot_ms'] / med['on']['tpot_ms']:.3f}" if mode == "on" else ""
            print(f"{b:>5} {mode:>5} {m['tpot_ms']:>8.2f} {m['tok_s']:>8.1f} "
                  f"{m['step_ms']:>8.2f} {ratio:>12}")
        if b == 1 and floor is not None:
            print(f"{'':>5} floor {floor:>8.2f} (TPOT off/on = {med['off']['tpot_ms'] / floor:.2f}x"
                  f" / {med['on']['tpot_ms'] / floor:.2f}x the floor)")
    if not args.no_result:
        cfg = {"model": "smollm2-135m", "prompt": args.prompt_len,
               "new_tokens": args.new_tokens, "dtype": str(engine.dtype),
               "quantization": engine.quantization}
        figures = [Figure(f"async scheduling {mode}, batch {b}", "tokenmill",
                          f"decode batch {b}", "tok/s",
                          [b * 1e3 / r["tpot_ms"] for r in results[(b, mode)]], True,
                          {**cfg, "async_scheduling": mode == "on", "batch": b})
                   for b in args.batches for mode in ("off", "on")]
        results_mod.write(results_mod.build("async-scheduling", "Async scheduling A/B",
                                            figures))


if __name__ == "__main__":
    main()
