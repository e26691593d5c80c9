"""W4 prefill (PERFORMANCE.md): one 512-token prompt, TTFT, tokenmill vs transformers and llama.cpp.

One prompt of 512 random token ids (seed 0), one output token. Metric: TTFT
(request in -> first token out), median of --repeats runs. In the same run:
tokenmill's default, tokenmill bf16 without quantization, the opt-in
`--batched-linears mlp-int8` (where AVX512-VNNI runs it), transformers bf16
and fp32 (`generate` with max_new_tokens=1), and llama.cpp's `llama-bench -p
512 -n 0` (pp512 on the same Q4_1 GGUF, 2 threads; built by
benchmarks/peers/build_llama_cpp.sh; its TTFT is 512 / pp512 tok/s). The
floor is the prefill's FLOPs over the bf16 matmul rate (PERFORMANCE.md: 435
GFLOP/s on small shapes, 920 on large ones); tokenmill's default is also held
against this CPU's measured floor for the arithmetic it runs (`tokenmill explain`).
A peer that cannot be set up is skipped with the reason.

    .venv/bin/python benchmarks/prefill.py
    .venv/bin/python benchmarks/prefill.py --peers llama   # one peer
    .venv/bin/python benchmarks/prefill.py --skip-peers    # tokenmill only
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
from floors import QUIET_BF16_TFLOP_S, explain, floor_lines, prefill_floor_ms
from peers import add_peer_args, ensure_llama_cpp, run_llama_bench, selected_peers, skip

from tokenmill.quant.mlp_int8 import available as mlp_int8_available

PEERS = ("llama", "transformers")


def run_tokenmill(prompt: list[int], repeats: int, against_floor: bool = False,
                  **engine_kwargs) -> list[float]:
    from tokenmill import LLM, SamplingParams

    # prefix caching off, and the whole prompt in one chunk: each repeat is a cold prefill
    llm = LLM(BENCH_MODEL, enable_prefix_caching=False,
              max_num_batched_tokens=max(len(prompt), 512), **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    ttfts = []
    for _ in range(repeats):
        m = llm.generate([prompt], params, use_tqdm=False)[0].metrics
        ttfts.append(1e3 * (m.first_token_time - m.arrival_time))
    if against_floor:
        print("  tokenmill default against this CPU's floor (tokenmill explain --hardware cpu):")
        served = {"engine": "tokenmill", "quantization": llm.engine.quantization,
                  "dtype": str(llm.engine.dtype)}
        for line in floor_lines(explain({
                "config": {"model": BENCH_MODEL, "num_requests": 1, "server_config": served},
                "summary": {"num_completed": 1, "mean_input_tokens": len(prompt),
                            "mean_output_tokens": 1,
                            "ttft_ms": {"p50": statistics.median(ttfts)}}})):
            print(f"    {line}")
    return ttfts


@torch.inference_mode()
def run_transformers(prompt: list[int], repeats: int, dtype: str) -> list[float]:
    model = load_transformers(dtype)
    ids = torch.tensor([prompt])
    ttfts = []
    for i in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=1, pad_token_id=0)
        if i:
            ttfts.append(1e3 * (time.perf_counter() - t0))
    return ttfts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flops", type=float, default=QUIET_BF16_TFLOP_S,
                    help="bf16 TFLOP/s for the floor (default: PERFORMANCE.md's small-shape rate)")
    ap.add_argument("--skip-fp32", action="store_true", help="skip the transformers fp32 peer")
    ap.add_argument("--llama-repetitions", type=int, default=5, help="llama-bench -r")
    add_peer_args(ap, PEERS)
    args = ap.parse_args()
    peers = selected_peers(args, PEERS)
    print(f"W4 prefill · {machine()}")
    floor_ms = prefill_floor_ms(args.prompt_len, args.flops)
    print(f"one {args.prompt_len}-token prompt, TTFT medians of {args.repeats}; floor "
          f"{floor_ms:.0f} ms at {args.flops * 1e3:g} GFLOP/s bf16 "
          f"({prefill_floor_ms(args.prompt_len, 0.92):.0f} ms at the large-shape 920)")
    rng = random.Random(0)
    prompt = [rng.randrange(100, 49152) for _ in range(args.prompt_len)]
    llama = None
    if "llama" in peers:
        llama, why = ensure_llama_cpp()
        if llama is None:
            skip("llama.cpp", why)
    results: dict[str, list[float]] = {}
    results["tokenmill default"] = run_tokenmill(prompt, args.repeats, against_floor=True)
    results["tokenmill bf16, no quantization"] = run_tokenmill(
        prompt, args.repeats, dtype="bfloat16", quantization="none")
    if mlp_int8_available():  # opt-in: it misses the accuracy gate (BENCHMARKS.md)
        results["tokenmill --batched-linears mlp-int8"] = run_tokenmill(
            prompt, args.repeats, batched_linears="mlp-int8")
    if "transformers" in peers:
        results["transformers bf16"] = run_transformers(prompt, args.repeats, "bfloat16")
        if not args.skip_fp32:
            results["transformers fp32"] = run_transformers(prompt, args.repeats, "float32")
    if llama is not None:
        pp = run_llama_bench(llama, embedded_gguf(), args.prompt_len, 0,
                             repetitions=args.llama_repetitions)
        samples = pp["samples_tok_s"] or [pp["tok_s"]]
        results[f"llama.cpp pp{args.prompt_len} (q4_1)"] = [
            1e3 * args.prompt_len / x for x in samples]
    tm = statistics.median(results["tokenmill default"])
    for name, ttfts in results.items():
        ttft = statistics.median(ttfts)
        print(f"{name:<34} TTFT {median_spread(ttfts)} ms; {args.prompt_len / ttft * 1e3:.0f} "
              f"tok/s; {ttft / floor_ms:.2f}x floor; tokenmill default is "
              f"{ttft / tm:.2f}x faster")
    if "transformers bf16" in results:
        hf = statistics.median(results["transformers bf16"])
        print(f"target: TTFT <= 1/2 of transformers bf16 (same run, {hf:.0f} ms) -> "
              f"{tm:.0f} ms, ratio {hf / tm:.2f}x: {'met' if tm <= hf / 2 else 'missed'}")
    if llama is not None:
        ll = statistics.median(results[f"llama.cpp pp{args.prompt_len} (q4_1)"])
        print(f"target: faster than llama.cpp pp{args.prompt_len} (same run, {ll:.0f} ms) -> "
              f"{tm:.0f} ms, ratio {ll / tm:.2f}x: {'met' if tm < ll else 'missed'}")


if __name__ == "__main__":
    main()
