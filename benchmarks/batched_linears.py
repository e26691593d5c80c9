"""Issue 21: the batched (16-64 row) linears, bf16 vs w8a8, as same-process A/B ratios.

Two parts, both timed in CPU time of one thread (`time.thread_time`, torch at one
thread), which a shared, busy machine disturbs far less than wall time (at 2 threads
under load, OpenMP's spinning makes wall times meaningless):

1. kernels: one decode step's linears at SmolLM2-135M's shapes (30 weights per layer
   shape, the LM head once, so weights come from memory as in a step): oneDNN's packed
   bf16 (the default large-batch path, quant/dense.py), w8a8 (quant/int8_dynamic.py)
   and torch._int_mm (int8 x int8 -> int32 via oneDNN, with per-token quantization in
   torch ops), alternating, the minimum of --repeats runs each.
2. engine: an LLMEngine per path in one process, N requests of 128-token prompts
   decoding together, steps alternating between the engines; median step time.

    .venv/bin/python benchmarks/batched_linears.py [--batches 16,32,64] [--repeats 5]
        [--skip-kernels] [--skip-engine]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = {"qkv": (576, 960, 30), "o_proj": (576, 576, 30), "gate_up": (576, 3072, 30),
          "down": (1536, 576, 30), "lm_head": (576, 49152, 1)}  # K, N, per step


def _int_mm(weight: torch.Tensor):
    from tokenmill.quant.int8_dynamic import quantize_weight

    codes, scale = quantize_weight(weight)
    codes_t = codes.t().contiguous()

    def run(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sx = xf.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
        xq = torch.round(xf / sx).to(torch.int8)
        return (torch._int_mm(xq, codes_t).float() * sx * scale).bfloat16()
    return run


def kernels(batches: list[int], repeats: int) -> None:
    from tokenmill.quant.dense import DenseWeight
    from tokenmill.quant.int8_dynamic import Int8DynamicWeight

    makers = {"bf16": DenseWeight, "w8a8": Int8DynamicWeight, "int_mm": _int_mm}
    g = torch.Generator().manual_seed(0)
    ops = {}
    for name, (k, n, count) in SHAPES.items():
        weights = [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for _ in range(count)]
        for method, make in makers.items():
            ops[name, method] = [make(w) for w in weights]
    times: dict[tuple, list[float]] = {}
    for _ in range(repeats):
        for m in batches:
            for name, (k, _, _) in SHAPES.items():
                x = torch.randn(m, k, generator=g).bfloat16()
                for method in makers:
                    fns = ops[name, method]
                    for f in fns:
                        f(x)  # warm
                    t = time.thread_time()
                    for f in fns:
                        f(x)
                    times.setdefault((m, name, method), []).append(time.thread_time() - t)
    for m in batches:
        total = dict.fromkeys(makers, 0.0)
        for name in SHAPES:
            cells = []
            for method in makers:
                v = min(times[m, name, method])
                total[method] += v
                cells.append(f"{method} {v * 1e3:6.2f}")
            print(f"rows {m:3d} {name:8s} " + "  ".join(cells) + "  ms per step")
        print(f"rows {m:3d} {'all':8s} " + "  ".join(f"{k} {v * 1e3:6.2f}"
                                                    for k, v in total.items())
              + f"  w8a8/bf16 {total['w8a8'] / total['bf16']:.3f}")


def engine(batches: list[int], steps: int) -> None:
    from tokenmill.config import CacheConfig, EngineConfig
    from tokenmill.engine.core.llm_engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams

    engines = {name: LLMEngine(EngineConfig(batched_linears=name, max_num_seqs=max(batches),
                                            cache=CacheConfig(enable_prefix_caching=False)))
               for name in ("bf16", "w8a8")}
    g = torch.Generator().manual_seed(0)
    for b in batches:
        prompts = [torch.randint(100, 40000, (128,), generator=g).tolist() for _ in range(b)]
        warm = -(-b * 128 // 1024) + 3  # the prompts' chunks, then decode
        params = SamplingParams(temperature=0.0, max_tokens=warm + steps + 8, ignore_eos=True)
        for e in engines.values():
            for i, p in enumerate(prompts):
                e.add_request(f"{b}-{i}", p, params)
            for _ in range(warm):
                e.step()
        times: dict[str, list[float]] = {n: [] for n in engines}
        for _ in range(steps):
            for name, e in engines.items():
                t = time.thread_time()
                e.step()
                times[name].append(time.thread_time() - t)
        med = {n: statistics.median(v) for n, v in times.items()}
        print(f"engine, {b} requests decoding: step " + ", ".join(
            f"{n} {v * 1e3:.1f} ms" for n, v in med.items())
            + f"; w8a8/bf16 {med['w8a8'] / med['bf16']:.3f}")
        for e in engines.values():
            while e.has_unfinished_requests():
                e.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="16,32,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12, help="engine steps timed per path")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    from tokenmill.quant.int8_dynamic import available

    if not available():
        raise SystemExit("the w8a8 kernel is not built here (no C compiler or no AVX512-VNNI)")
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    print("CPU time of one thread; same-process A/B ratios")
    if not args.skip_kernels:
        kernels(batches, args.repeats)
    if not args.skip_engine:
        engine(batches, args.steps)


if __name__ == "__main__":
    main()
