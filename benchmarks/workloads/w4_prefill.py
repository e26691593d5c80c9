"""W4 prefill (PERFORMANCE.md): one 512-token prompt, TTFT, tokenmill vs llama.cpp and transformers.

One prompt of 512 random token ids (seed 0), one output token, on --model (any GGUF
file, or an alias; default the embedded SmolLM2-135M Q4_1). Metric: prompt tokens/s =
512 / TTFT (request in -> first token out), medians of --repeats runs, and resident
memory (peak RSS) beside it. In the same run: tokenmill's default (and, on the default
model, bf16 without quantization and the opt-in `--batched-linears mlp-int8` where
AVX512-VNNI runs it), llama.cpp's `llama-bench -t 2 -p 512 -n 0` (pp512) on the SAME
file with its own peak RSS, and transformers bf16 / fp32 (`generate` with
max_new_tokens=1, the file dequantized). The floor is the prefill's FLOPs over the
bf16 matmul rate (PERFORMANCE.md: 435 GFLOP/s on small shapes). A peer that cannot be
set up, or a model tokenmill refuses, is a note in the result, not a crash.

    python -m benchmarks run w4
    python -m benchmarks run w4 --peers llama --model ~/models/gemma-3-270m.Q4_K_M.gguf
    python -m benchmarks run w4 --skip-peers                 # tokenmill only

The result: benchmarks/results/<date>-<machine class>-w4[-<model>].json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks import memory, results
from benchmarks.common import (
    DEFAULT_MODEL,
    gguf_vocab_size,
    load_transformers,
    machine,
    median_spread,
    model_gguf,
    random_prompt,
    short_command,
)
from benchmarks.floors import (
    INT8_OVER_BF16,
    QUIET_BF16_TFLOP_S,
    prefill_floor_ms,
    prefill_int8_share,
)
from benchmarks.peers import add_peer_args, ensure_llama_cpp, run_llama_bench, selected_peers
from benchmarks.results import Figure

PEERS = ("llama", "transformers")
TITLE = "W4 prefill"
RSS_NOTE = ("peak RSS is the whole process's: tokenmill's Python process with torch, from "
            "engine load to the last run; llama-bench's own process")


def run_tokenmill(model: Path, prompt: list[int], repeats: int, **engine_kwargs
                  ) -> tuple[list[float], float | None]:
    """TTFT (ms) per repeat, and peak RSS (MiB) over load and runs."""
    from tokenmill import LLM, SamplingParams

    memory.reset_peak()
    # prefix caching off, and the whole prompt in one chunk: each repeat is a cold prefill
    llm = LLM(str(model), enable_prefix_caching=False,
              max_num_batched_tokens=max(len(prompt), 512), **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    ttfts = []
    for _ in range(repeats):
        m = llm.generate([prompt], params, use_tqdm=False)[0].metrics
        ttfts.append(1e3 * (m.first_token_time - m.arrival_time))
    rss = memory.peak_rss_mib()
    del llm
    return ttfts, rss


@torch.inference_mode()
def run_transformers(model: Path, prompt: list[int], repeats: int, dtype: str) -> list[float]:
    hf = load_transformers(dtype, model)
    ids = torch.tensor([prompt])
    ttfts = []
    for i in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                    max_new_tokens=1, pad_token_id=0)
        if i:
            ttfts.append(1e3 * (time.perf_counter() - t0))
    return ttfts


def main(argv: list[str] | None = None) -> None:
    from tokenmill.quant.mlp_int8 import available as mlp_int8_available

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="GGUF file (or alias) that tokenmill and llama-bench both run")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flops", type=float, default=QUIET_BF16_TFLOP_S,
                    help="bf16 TFLOP/s for the floor (default: PERFORMANCE.md's small-shape rate)")
    ap.add_argument("--skip-fp32", action="store_true", help="skip the transformers fp32 peer")
    ap.add_argument("--llama-repetitions", type=int, default=5,
                    help="llama-bench -r (its runs are the figure's runs)")
    ap.add_argument("--no-result", action="store_true",
                    help="print only; write no benchmarks/results/ file")
    add_peer_args(ap, PEERS)
    args = ap.parse_args(argv)
    peers = selected_peers(args, PEERS)
    gguf = model_gguf(args.model)
    default_model = args.model == DEFAULT_MODEL
    print(f"W4 prefill · {gguf.name} · {machine()}")
    try:
        share = prefill_int8_share(str(gguf))
        floor_ms: float | None = prefill_floor_ms(args.prompt_len, args.flops, model=str(gguf),
                                                  int8_share=share)
        rates = f"{args.flops * 1e3:g} GFLOP/s bf16"
        if share != "none":
            rates += (f", {INT8_OVER_BF16 * args.flops * 1e3:g} GOP/s int8 for "
                      + ("every linear" if share == "all" else "all but the attention's "
                         "linears") + " (the default's prompt kernels here)")
        print(f"one {args.prompt_len}-token prompt, TTFT medians of {args.repeats}; floor "
              f"{floor_ms:.0f} ms at {rates}", flush=True)
    except Exception as e:  # noqa: BLE001 - a floor is commentary, never a failure
        floor_ms = None
        print(f"one {args.prompt_len}-token prompt; no floor ({e!r})", flush=True)
    prompt = random_prompt(args.prompt_len, gguf_vocab_size(gguf))
    cfg = {"model": gguf.name, "prompt": args.prompt_len}
    figures: list[Figure] = []
    notes: list[str] = [RSS_NOTE]

    def add(label: str, engine: str, ttfts: list[float], rss: float | None, **extra) -> None:
        config = {**cfg, **extra}
        print(f"{label:<38} TTFT {median_spread(ttfts)} ms; "
              f"{args.prompt_len / statistics.median(ttfts) * 1e3:.0f} tok/s"
              + (f"; {statistics.median(ttfts) / floor_ms:.2f}x floor" if floor_ms else "")
              + (f"; peak RSS {rss:.0f} MiB" if rss is not None else ""), flush=True)
        figures.append(Figure(label, engine, "prefill", "tok/s",
                              [args.prompt_len / t * 1e3 for t in ttfts], True, config))
        if rss is not None:
            figures.append(Figure(label, engine, "peak RSS", "MiB", [rss], False, config))

    llama = None
    if "llama" in peers:
        llama, why = ensure_llama_cpp()
        if llama is None:
            notes.append(f"llama.cpp skipped: {why}")
            print(f"[peers] llama.cpp SKIPPED: {why}")
    configs: list[tuple[str, dict]] = [("tokenmill default", {})]
    if default_model:
        configs.append(("tokenmill bf16, no quantization",
                        {"dtype": "bfloat16", "quantization": "none"}))
        if mlp_int8_available():  # the default's large batches here; bf16 was before
            configs.append(("tokenmill --batched-linears bf16",
                            {"batched_linears": "bf16"}))
    for label, kwargs in configs:
        try:
            ttfts, rss = run_tokenmill(gguf, prompt, args.repeats, **kwargs)
        except Exception as e:  # noqa: BLE001 - e.g. an architecture tokenmill refuses
            reason = str(e).splitlines()[0] if str(e) else repr(e)
            notes.append(f"{label}: refused ({type(e).__name__}: {reason})")
            print(f"{label}: REFUSED: {type(e).__name__}: {reason}", flush=True)
            break
        add(label, "tokenmill", ttfts, rss, **kwargs)
    if llama is not None:
        pp = run_llama_bench(llama, gguf, args.prompt_len, 0,
                             repetitions=args.llama_repetitions)
        samples = pp["samples_tok_s"] or [pp["tok_s"]]
        add(f"llama.cpp pp{args.prompt_len}", "llama.cpp",
            [1e3 * args.prompt_len / x for x in samples], pp["peak_rss_mib"],
            command=short_command(pp["command"], gguf), llama_build=pp["build"])
    if "transformers" in peers:
        for dtype in ("bfloat16",) if args.skip_fp32 else ("bfloat16", "float32"):
            try:
                ttfts = run_transformers(gguf, prompt, args.repeats, dtype)
            except Exception as e:  # noqa: BLE001 - transformers does not read every GGUF
                notes.append(f"transformers skipped: {type(e).__name__}: {e}")
                print(f"[peers] transformers SKIPPED: {e}")
                break
            add(f"transformers {dtype}", "transformers", ttfts, None, dtype=dtype)
    result = results.build("w4", TITLE, figures, notes=notes,
                           variant=None if default_model else gguf.stem)
    for r in result["ratios"]:
        print(f"{r['tokenmill']} vs {r['peer']} ({r['metric']}, same run): "
              f"{r['ratio']:.2f}x (> 1 = tokenmill better)")
    if not args.no_result:
        results.write(result)
