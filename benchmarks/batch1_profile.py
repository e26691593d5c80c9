"""Where a batch-1 decode step goes (issue 21): cProfile over --steps engine steps.

The embedded SmolLM2-135M with one request (W3's: a 128-token prompt of random ids,
seed 0, greedy); after its prefill, --steps decode steps run under cProfile, and the
cumulative time per step of the step's parts is printed: the linears (their ctypes
calls included), the LM head, attention (KV store and paged decode), the fused norm,
rotary and SiLU calls, sampling, scheduling and the runner's batch preparation.
cProfile adds a fixed cost to every Python call, so the Python-heavy parts read high;
compare paths in one run, not with wall-clock TPOT.

    .venv/bin/python benchmarks/batch1_profile.py --paths gguf,gguf-a16
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
from collections.abc import Callable

import torch

PARTS: dict[str, Callable[[str, int, str], bool]] = {
    "whole step": lambda f, line, fn: fn == "step" and f.endswith("engine/llm_engine.py"),
    "model forward (LM head excluded)": lambda f, line, fn: fn == "forward"
    and f.endswith("models/llama.py") and 100 < line < 110,  # LlamaModel.forward
    "linears (quantized, LM head included)": lambda f, line, fn: fn == "forward"
    and f.endswith("quant/linear.py") and line > 100,
    "LM head (compute_logits)": lambda f, line, fn: fn == "compute_logits",
    "attention: paged decode": lambda f, line, fn: fn == "paged_attention_fast",
    "attention: KV store": lambda f, line, fn: fn == "store_kv" and "kernels" in f,
    "rms_norm (+ residual add)": lambda f, line, fn: fn == "rms_norm" and "layer_ops" in f,
    "rotary": lambda f, line, fn: fn == "rotary_" and "layer_ops" in f,
    "silu * up": lambda f, line, fn: fn == "silu_mul" and "layer_ops" in f,
    "sampler": lambda f, line, fn: fn == "__call__" and f.endswith("engine/sampler.py"),
    "scheduler.schedule": lambda f, line, fn: fn == "schedule" and "scheduler" in f,
    "runner.prepare": lambda f, line, fn: fn == "prepare" and "model_runner" in f,
}


def profile(path: str, steps: int, prompt: list[int]) -> dict[str, float]:
    from tokenmill import LLM, SamplingParams

    llm = LLM("smollm2-135m", enable_prefix_caching=False, quantization=path)
    llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    engine = llm.engine
    engine.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=steps + 1,
                                                   ignore_eos=True))
    engine.step()  # the prefill
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    while engine.has_unfinished_requests():
        engine.step()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    return {name: sum(v[3] for (f, line, fn), v in stats.items() if match(f, line, fn))
            / steps * 1e3 for name, match in PARTS.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="gguf,gguf-a16", help="--quantization methods")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(128)]
    paths = args.paths.split(",")
    results = {p: profile(p, args.steps, prompt) for p in paths}
    print(f"ms per decode step under cProfile, {torch.get_num_threads()} threads, "
          f"{args.steps} steps")
    print(f"{'part':40s}" + "".join(f"{p:>12s}" for p in paths))
    for name in PARTS:
        print(f"{name:40s}" + "".join(f"{results[p][name]:12.2f}" for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
