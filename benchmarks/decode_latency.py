"""W3 single-stream decode (PERFORMANCE.md): tokenmill vs llama.cpp and transformers, one run.

Batch 1, a 128-token prompt (random token ids, seed 0), 128 new tokens,
ignore_eos, temperature 0. Metric: TPOT (time per output token after the
first) and decode tok/s = 1000 / TPOT, medians of --repeats runs. In the same
run: tokenmill's default (bf16 compute + native GGUF int4), tokenmill bf16
without quantization, llama.cpp's `llama-bench -p 0 -n 128` (tg128, the same
Q4_1 GGUF, 2 threads; built by benchmarks/peers/build_llama_cpp.sh) and
transformers bf16 batch 1. Each is held against its own floor (weight + KV
bytes read per step / memory bandwidth: PERFORMANCE.md's quiet-machine 47 GB/s by
default, the GGUF's own Q4_1 and Q8_0 bytes, the KV at the decode's mean context);
tokenmill's default is also held against the streaming read this machine gives in
this run, measured just before and after it. A peer that cannot be set up is
skipped with the reason.

    .venv/bin/python benchmarks/decode_latency.py
    .venv/bin/python benchmarks/decode_latency.py --peers llama   # one peer
    .venv/bin/python benchmarks/decode_latency.py --skip-peers    # tokenmill only
    TOKENMILL_FUSED_DECODE=0 .venv/bin/python benchmarks/decode_latency.py  # module path

The default line says whether its decode steps ran the fused batch-1 step
(engine/fused_decode.py); benchmarks/batch1_kernels.py --paths
gguf-a16/modules,gguf-a16 is that step's A/B in one process.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import BENCH_MODEL, embedded_gguf, load_transformers, machine, median_spread
from floors import QUIET_READ_GB_S, decode_floor_ms, roofline_dtype
from peers import add_peer_args, ensure_llama_cpp, run_llama_bench, selected_peers, skip

PEERS = ("llama", "transformers")
TARGET_VS_LLAMA = 1.2  # PERFORMANCE.md: >= 1.2x llama-bench tg128 in the same run


def read_now_gb_s() -> float:
    """The median of the roofline micro-benchmark's streaming reads, now (GB/s)."""
    from tokenmill.roofline.hardware import read_bandwidth_tries

    _, tries = read_bandwidth_tries(torch)
    return statistics.median(tries) / 1e9


def run_tokenmill(prompt: list[int], new_tokens: int, repeats: int, **engine_kwargs
                  ) -> tuple[list[float], list[float], str, bool]:
    """TPOT (ms) and TTFT (ms) per repeat, the roofline weight dtype, and whether decode
    ran the fused batch-1 step."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(BENCH_MODEL, enable_prefix_caching=False, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    tpots, ttfts = [], []
    for _ in range(repeats):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        m = out.metrics
        assert len(out.outputs[0].token_ids) == new_tokens
        ttfts.append(1e3 * (m.first_token_time - m.arrival_time))
        tpots.append(1e3 * (m.finished_time - m.first_token_time) / (new_tokens - 1))
    weights = roofline_dtype(llm.engine.quantization, str(llm.engine.dtype))
    fused = llm.engine.runner.fused_decode is not None
    del llm
    return tpots, ttfts, weights, fused


@torch.inference_mode()
def run_transformers(prompt: list[int], new_tokens: int, repeats: int, dtype: str
                     ) -> tuple[list[float], list[float]]:
    """TPOT from two timed generates: (t(N tokens) - t(1 token)) / (N - 1)."""
    model = load_transformers(dtype)
    ids = torch.tensor([prompt])

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        assert out.shape[1] - ids.shape[1] == n
        return time.perf_counter() - t0

    timed(4)  # warm-up
    tpots, ttfts = [], []
    for _ in range(repeats):
        first = timed(1)
        total = timed(new_tokens)
        ttfts.append(1e3 * first)
        tpots.append(1e3 * (total - first) / (new_tokens - 1))
    return tpots, ttfts


def report(name: str, tpots: list[float], ttfts: list[float] | None, floor_ms: float | None
           ) -> float:
    tpot = statistics.median(tpots)
    line = f"{name:<34} TPOT {median_spread(tpots)} ms, {1e3 / tpot:.1f} tok/s"
    if ttfts:
        line += f", TTFT {statistics.median(ttfts):.0f} ms"
    if floor_ms is not None:
        line += f"; {tpot / floor_ms:.2f}x its floor ({floor_ms:.2f} ms)"
    print(line)
    return tpot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bandwidth", type=float, default=QUIET_READ_GB_S,
                    help="GB/s for the floor (default: PERFORMANCE.md's quiet-machine read)")
    ap.add_argument("--llama-repetitions", type=int, default=5,
                    help="llama-bench -r (its own median-free mean and stddev)")
    add_peer_args(ap, PEERS)
    args = ap.parse_args()
    peers = selected_peers(args, PEERS)
    print(f"W3 batch-1 decode · {machine()}")
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, "
          f"medians of {args.repeats}; floors at {args.bandwidth:g} GB/s")
    rng = random.Random(0)
    prompt = [rng.randrange(100, 49152) for _ in range(args.prompt_len)]
    llama = None
    if "llama" in peers:
        llama, why = ensure_llama_cpp()
        if llama is None:
            skip("llama.cpp", why)

    def floor(weights: str) -> float:
        return decode_floor_ms(weights, args.prompt_len, args.new_tokens, args.bandwidth)

    read_before = read_now_gb_s()
    tpots, ttfts, weights, fused = run_tokenmill(prompt, args.new_tokens, args.repeats)
    read_after = read_now_gb_s()
    step = "fused decode step" if fused else "module path"
    default_floor = floor(weights)
    default_tpot = report(f"tokenmill default ({weights}, {step})", tpots, ttfts,
                          default_floor)
    read = (read_before + read_after) / 2
    here = default_floor * args.bandwidth / read  # the same bytes at this run's read
    print(f"  this machine's streaming read in this run: {read_before:.1f} GB/s before, "
          f"{read_after:.1f} after (medians of 5); at {read:.1f} GB/s its floor is "
          f"{here:.2f} ms and TPOT {default_tpot / here:.2f}x it")
    tpots, ttfts, weights, _ = run_tokenmill(prompt, args.new_tokens, args.repeats,
                                         dtype="bfloat16", quantization="none")
    report("tokenmill bf16, no quantization", tpots, ttfts, floor(weights))
    tm_tok_s = 1e3 / default_tpot
    if llama is not None:
        # tg N: N tokens generated after an empty prompt, 2 threads, its mean of -r runs
        tg = run_llama_bench(llama, embedded_gguf(), 0, args.new_tokens,
                             repetitions=args.llama_repetitions)
        samples = [1e3 / x for x in tg["samples_tok_s"]] or [1e3 / tg["tok_s"]]
        report(f"llama.cpp tg{args.new_tokens} (the same GGUF)", samples, None,
               decode_floor_ms("gguf", 1, args.new_tokens, args.bandwidth))
        print(f"  llama-bench: {tg['tok_s']:.1f} ± {tg['stddev_tok_s']:.1f} tok/s")
        ok = tm_tok_s >= TARGET_VS_LLAMA * tg["tok_s"] and default_tpot <= 2 * default_floor
        print(f"tokenmill default vs llama.cpp tg{args.new_tokens} (same run): "
              f"{tm_tok_s / tg['tok_s']:.2f}x; target >= {TARGET_VS_LLAMA}x and TPOT <= 2x "
              f"its floor ({default_tpot / default_floor:.2f}x): {'met' if ok else 'missed'}")
    if "transformers" in peers:
        tpots, ttfts = run_transformers(prompt, args.new_tokens, args.repeats, "bfloat16")
        hf_tpot = report("transformers bf16", tpots, ttfts, floor("bf16"))
        print(f"tokenmill default vs transformers bf16 (same run): "
              f"{hf_tpot / default_tpot:.1f}x")


if __name__ == "__main__":
    main()
