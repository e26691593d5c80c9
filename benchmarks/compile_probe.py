"""Does torch.compile (CPU inductor) pay for tokenmill's batch-1 decode? One run.

Issue 7 asks to compile the decode step "where it pays" and to measure it. This
probe compiles the per-layer elementwise chains (RMSNorm, SiLU * up, rotary:
17 of the ~40 ops of a layer) with dynamic shapes and times W3's decode (batch
1, 128-token prompt, 128 new tokens, greedy) before and after, in the same
process: eager first, then the same engine with the chains compiled. It prints
the compile time (first call) and the TPOT ratio. tokenmill itself does not
compile anything (see BENCHMARKS.md for the result and why).

    .venv/bin/python benchmarks/compile_probe.py
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import machine


def tpot_ms(llm, prompt: list[int], repeats: int = 3) -> float:
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    runs = []
    for _ in range(repeats):
        m = llm.generate([prompt], params, use_tqdm=False)[0].metrics
        runs.append(1e3 * (m.finished_time - m.first_token_time) / 127)
    return statistics.median(runs)


def compile_elementwise_chains() -> None:
    from tokenmill.models import layers, llama

    layers.RMSNorm.forward = torch.compile(layers.RMSNorm.forward, dynamic=True)
    layers.RotaryEmbedding.rotate = torch.compile(layers.RotaryEmbedding.rotate, dynamic=True)
    llama.silu_and_mul = torch.compile(layers.silu_and_mul, dynamic=True)


def main() -> None:
    from tokenmill import LLM, SamplingParams

    print(f"compile probe · {machine()}")
    llm = LLM("smollm2-135m", enable_prefix_caching=False)
    prompt = [random.Random(0).randrange(100, 40000) for _ in range(128)]
    llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    eager = tpot_ms(llm, prompt)
    print(f"eager:    TPOT {eager:.1f} ms (median of 3)")
    compile_elementwise_chains()
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)
    print(f"compiled: first call {time.perf_counter() - t:.1f} s (compiles; inductor caches "
          "it on disk for later starts)")
    compiled = tpot_ms(llm, prompt)
    print(f"compiled: TPOT {compiled:.1f} ms (median of 3) -> {eager / compiled:.2f}x eager")


if __name__ == "__main__":
    main()
