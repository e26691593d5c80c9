"""W3 single-stream decode (PERFORMANCE.md): tokenmill vs llama.cpp and transformers, one run.

Batch 1, a 128-token prompt (random token ids, seed 0), 128 new tokens, ignore_eos,
temperature 0, on --model (any GGUF file, or an alias; default the embedded
SmolLM2-135M Q4_1). Metric: decode tok/s = 1000 / TPOT (time per output token after
the first), medians of --repeats runs, and resident memory (peak RSS) beside it. In the
same run: tokenmill's default (and, on the default model, tokenmill bf16 without
quantization), llama.cpp's `llama-bench -t 2 -p 0 -n 128` (tg128) on the SAME file
(built by benchmarks/peers/build_llama_cpp.sh) with its own peak RSS, and transformers
bf16 batch 1 (the file dequantized). Each is held against its floor (weight + KV bytes
read per step / memory bandwidth, PERFORMANCE.md's quiet-machine 47 GB/s by default).
A peer that cannot be set up, or a model tokenmill refuses, is a note in the result,
not a crash: the other figures are still written.

    python -m benchmarks run w3
    python -m benchmarks run w3 --peers llama --model ~/models/SmolLM2-135M.Q4_K_M.gguf
    python -m benchmarks run w3 --skip-peers                    # tokenmill only
    TOKENMILL_FUSED_DECODE=0 python -m benchmarks run w3        # the module path

The result: benchmarks/results/<date>-<machine class>-w3[-<model>].json.
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
from benchmarks.floors import QUIET_READ_GB_S, decode_floor_ms, roofline_dtype
from benchmarks.peers import add_peer_args, ensure_llama_cpp, run_llama_bench, selected_peers
from benchmarks.results import Figure

PEERS = ("llama", "transformers")
TITLE = "W3 single-stream decode"
RSS_NOTE = ("peak RSS is the whole process's: tokenmill's Python process with torch, from "
            "engine load to the last run; llama-bench's own process")


def read_now_gb_s() -> float:
    """The median of the roofline micro-benchmark's streaming reads, now (GB/s)."""
    from tokenmill.roofline.hardware import read_bandwidth_tries

    _, tries = read_bandwidth_tries(torch)
    return statistics.median(tries) / 1e9


def run_tokenmill(model: Path, prompt: list[int], new_tokens: int, repeats: int,
                  **engine_kwargs) -> dict:
    """TPOT and TTFT (ms) per repeat, peak RSS (MiB) over load and runs, the roofline
    weight dtype, and whether decode ran the fused batch-1 step."""
    from tokenmill import LLM, SamplingParams

    memory.reset_peak()
    llm = LLM(str(model), enable_prefix_caching=False, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    tpots, ttfts = [], []
    for _ in range(repeats):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        m = out.metrics
        assert len(out.outputs[0].token_ids) == new_tokens
        ttfts.append(1e3 * (m.first_token_time - m.arrival_time))
        tpots.append(1e3 * (m.finished_time - m.first_token_time) / (new_tokens - 1))
    run = {"tpots": tpots, "ttfts": ttfts, "rss": memory.peak_rss_mib(),
           "weights": roofline_dtype(llm.engine.quantization, str(llm.engine.dtype)),
           "quantization": llm.engine.quantization,
           "dtype": str(llm.engine.dtype).removeprefix("torch."),
           "fused": llm.engine.runner.fused_decode is not None}
    del llm
    return run


@torch.inference_mode()
def run_transformers(model: Path, prompt: list[int], new_tokens: int, repeats: int,
                     dtype: str) -> tuple[list[float], list[float]]:
    """TPOT from two timed generates: (t(N tokens) - t(1 token)) / (N - 1)."""
    hf = load_transformers(dtype, model)
    ids = torch.tensor([prompt])

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
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


def show(name: str, tpots: list[float], floor_ms: float | None, rss: float | None = None
         ) -> None:
    tpot = statistics.median(tpots)
    line = f"{name:<36} TPOT {median_spread(tpots)} ms, {1e3 / tpot:.1f} tok/s"
    if floor_ms is not None:
        line += f"; {tpot / floor_ms:.2f}x its floor ({floor_ms:.2f} ms)"
    if rss is not None:
        line += f"; peak RSS {rss:.0f} MiB"
    print(line, flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="GGUF file (or alias) that tokenmill and llama-bench both run")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bandwidth", type=float, default=QUIET_READ_GB_S,
                    help="GB/s for the floor (default: PERFORMANCE.md's quiet-machine read)")
    ap.add_argument("--llama-repetitions", type=int, default=5,
                    help="llama-bench -r (its runs are the figure's runs)")
    ap.add_argument("--no-result", action="store_true",
                    help="print only; write no benchmarks/results/ file")
    # a path beside the default in the same run (the A/B a default change needs, issue 57)
    ap.add_argument("--quantization", default=None,
                    help="also run tokenmill with this --quantization (e.g. gguf-a8)")
    ap.add_argument("--batched-linears", default=None,
                    help="also run tokenmill with this --batched-linears (e.g. mlp-int8)")
    ap.add_argument("--kv-cache-dtype", default=None,
                    help="also run tokenmill with this --kv-cache-dtype (e.g. int8)")
    add_peer_args(ap, PEERS)
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error("--new-tokens: at least 2 (TPOT is the time after the first token)")
    peers = selected_peers(args, PEERS)
    gguf = model_gguf(args.model)
    default_model = args.model == DEFAULT_MODEL
    print(f"W3 batch-1 decode · {gguf.name} · {machine()}")
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, medians of "
          f"{args.repeats}; floors at {args.bandwidth:g} GB/s", flush=True)
    prompt = random_prompt(args.prompt_len, gguf_vocab_size(gguf))
    figures: list[Figure] = []
    notes: list[str] = [RSS_NOTE]
    cfg = {"model": gguf.name, "prompt": args.prompt_len, "new_tokens": args.new_tokens}

    def floor(weights: str) -> float | None:
        try:
            return decode_floor_ms(weights, args.prompt_len, args.new_tokens, args.bandwidth,
                                   model=str(gguf))
        except Exception as e:  # noqa: BLE001 - a floor is commentary, never a failure
            print(f"  (no floor: {str(e).splitlines()[-1] if str(e) else e!r})")
            return None

    def add(label: str, engine: str, tpots: list[float], rss: float | None, **extra) -> None:
        config = {**cfg, **extra}
        figures.append(Figure(label, engine, "decode", "tok/s", [1e3 / t for t in tpots],
                              True, config))
        if rss is not None:
            figures.append(Figure(label, engine, "peak RSS", "MiB", [rss], False, config))

    llama = None
    if "llama" in peers:
        llama, why = ensure_llama_cpp()
        if llama is None:
            notes.append(f"llama.cpp skipped: {why}")
            print(f"[peers] llama.cpp SKIPPED: {why}")
    configs = [("tokenmill default", {})]
    path = {k: v for k, v in (("quantization", args.quantization),
                              ("batched_linears", args.batched_linears),
                              ("kv_cache_dtype", args.kv_cache_dtype)) if v}
    if path:
        configs.append(("tokenmill " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                for k, v in path.items()), path))
    elif default_model:
        configs.append(("tokenmill bf16, no quantization",
                        {"dtype": "bfloat16", "quantization": "none"}))
    read_before = read_now_gb_s()
    for label, kwargs in configs:
        try:
            run = run_tokenmill(gguf, prompt, args.new_tokens, args.repeats, **kwargs)
        except Exception as e:  # noqa: BLE001 - e.g. an architecture tokenmill refuses
            reason = str(e).splitlines()[0] if str(e) else repr(e)
            notes.append(f"{label}: refused ({type(e).__name__}: {reason})")
            print(f"{label}: REFUSED: {type(e).__name__}: {reason}", flush=True)
            break
        step = "fused decode step" if run["fused"] else "module path"
        show(f"{label} ({run['weights']}, {step})", run["tpots"], floor(run["weights"]),
             run["rss"])
        add(label, "tokenmill", run["tpots"], run["rss"], weights=run["weights"],
            dtype=run["dtype"], decode_step=step)
    read = (read_before + read_now_gb_s()) / 2
    notes.append(f"streaming read of this machine in this run: {read:.1f} GB/s "
                 f"(floors above at {args.bandwidth:g} GB/s)")
    print(notes[-1], flush=True)
    if llama is not None:
        # tg N: N tokens generated after an empty prompt, 2 threads, -r runs
        tg = run_llama_bench(llama, gguf, 0, args.new_tokens,
                             repetitions=args.llama_repetitions)
        samples = tg["samples_tok_s"] or [tg["tok_s"]]
        tpots = [1e3 / x for x in samples]
        show(f"llama.cpp tg{args.new_tokens}", tpots, floor("gguf"), tg["peak_rss_mib"])
        add(f"llama.cpp tg{args.new_tokens}", "llama.cpp", tpots, tg["peak_rss_mib"],
            prompt=0, command=short_command(tg["command"], gguf), llama_build=tg["build"])
    if "transformers" in peers:
        try:
            tpots, _ = run_transformers(gguf, prompt, args.new_tokens, args.repeats,
                                        "bfloat16")
            show("transformers bf16", tpots, floor("bf16"))
            add("transformers bf16", "transformers", tpots, None, dtype="bfloat16")
        except Exception as e:  # noqa: BLE001 - transformers does not read every GGUF
            notes.append(f"transformers skipped: {type(e).__name__}: {e}")
            print(f"[peers] transformers SKIPPED: {e}")
    result = results.build("w3", TITLE, figures, notes=notes,
                           variant=None if default_model else gguf.stem)
    for r in result["ratios"]:
        print(f"{r['tokenmill']} vs {r['peer']} ({r['metric']}, same run): "
              f"{r['ratio']:.2f}x (> 1 = tokenmill better)")
    if not args.no_result:
        results.write(result)
