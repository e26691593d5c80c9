"""Batch-1 decode kernels (issue 21): the weight paths' TPOT A/B in one process.

The embedded SmolLM2-135M, W3's request (batch 1, a 128-token prompt of random ids,
seed 0, --new-tokens new tokens, ignore_eos, temperature 0), one engine per
--quantization path built up front; each round runs every path once, in turn, so
the paths see the same machine (on a busy one, read the paired ratios, not the
absolute times). Each path's median TPOT is held against its own floor (weight + KV
bytes per step / --bandwidth).

    python -m benchmarks run batch1-kernels                  # gguf vs gguf-a16 vs gguf-a8
    python -m benchmarks run batch1-kernels --paths gguf-a16/modules,gguf-a16

A path written METHOD/modules is METHOD's engine (the same one, not a second copy)
with its fused batch-1 decode step off for that generate (engine/fused_decode.py),
so `gguf-a16/modules,gguf-a16` is the fused step's A/B in one engine, alternating.
    OMP_NUM_THREADS=1 python -m benchmarks run batch1-kernels --threads 1 --rounds 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

import torch

from benchmarks.common import machine
from benchmarks.floors import QUIET_READ_GB_S, decode_floor_ms, roofline_dtype


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="gguf,gguf-a16/modules,gguf-a16,gguf-a8",
                    help="--quantization methods, the first the one the others are held "
                         "to; METHOD/modules: METHOD without the fused decode step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--bandwidth", type=float, default=QUIET_READ_GB_S)
    ap.add_argument("--no-result", action="store_true",
                    help="print only; write no benchmarks/results/ file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenmill import LLM, SamplingParams

    paths = args.paths.split(",")
    for p in paths:
        if p.partition("/")[2] not in ("", "modules"):
            ap.error(f"--paths {p!r}: a path is METHOD or METHOD/modules")
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    engines = {m: LLM("smollm2-135m", enable_prefix_caching=False, quantization=m)
               for m in dict.fromkeys(p.partition("/")[0] for p in paths)}
    llms = {p: engines[p.partition("/")[0]] for p in paths}
    for llm in engines.values():
        llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    print(f"machine: {machine()}; batch 1, prompt "
          f"{args.prompt_len}, {args.new_tokens} new tokens, {args.rounds} rounds")
    tpots: dict[str, list[float]] = {p: [] for p in paths}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for p, llm in llms.items():
            fused = llm.engine.runner.fused_decode
            if fused is not None:  # METHOD/modules: this generate without it
                fused.enabled = not p.endswith("/modules")
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            m = out.metrics
            tpots[p].append(1e3 * (m.finished_time - m.first_token_time) / (args.new_tokens - 1))
            tokens[p] = list(out.outputs[0].token_ids)
    base = paths[0]
    for p in paths:
        tpot = statistics.median(tpots[p])
        weights = roofline_dtype(llms[p].engine.quantization, str(llms[p].engine.dtype))
        floor = decode_floor_ms(weights, args.prompt_len, args.new_tokens, args.bandwidth)
        paired = [b / a for a, b in zip(tpots[p], tpots[base])]
        same = sum(a == b for a, b in zip(tokens[p], tokens[base]))
        print(f"{p:16s} TPOT {tpot:7.2f} ms ({1e3 / tpot:6.1f} tok/s), {tpot / floor:.2f}x its "
              f"floor ({floor:.2f} ms); {base} / {p} per round "
              f"{' '.join(f'{r:.2f}' for r in paired)} (median {statistics.median(paired):.2f}); "
              f"greedy tokens equal to {base}'s: {same}/{args.new_tokens}")
    if not args.no_result:
        from benchmarks import results
        from benchmarks.results import Figure

        figures = [Figure(p, "tokenmill", "decode", "tok/s", [1e3 / t for t in tpots[p]], True,
                          {"model": "smollm2-135m", "path": p, "prompt": args.prompt_len,
                           "new_tokens": args.new_tokens}) for p in paths]
        results.write(results.build("batch1-kernels", "Batch-1 decode by weight path",
                                    figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
