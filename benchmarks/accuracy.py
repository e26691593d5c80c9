"""The accuracy gate (issues 21 and 22): perplexity and greedy top-1 agreement of a
fast path against the bf16 baseline and the fp32 reference, through the real engine.

The text is fixed and public domain (tests/data/opticks_book1.txt: Newton's Opticks,
1730, the first ~6,600 tokens of Book I, from Project Gutenberg). It is cut into
windows of `context + 1` tokens; every position of a window after its first is scored
teacher-forced by a decode step reading the whole KV cache written so far
(tokenmill/engine/core/teacher_forced.py), so a quantized KV cache is read at up to
`context` tokens (with --score-last N only each window's last N positions are scored, the
rest is its prompt: a long context for N decode steps). With --mode prefill every
position is scored from one prefill of its window instead (vLLM's prompt_logprobs), so
prompt attention is what is checked: the tiled prompt kernel for a first chunk and
for the chunks over the cached part after it (the path's --max-num-batched-tokens sets
the chunks; with TOKENMILL_PROMPT_TILED=0, the row-by-row and cascade kernels). Per context: perplexity of the path and of
the baseline, their ratio, and the share of the first --positions positions where the
path's argmax equals the fp32 reference's (and the baseline's).

    .venv/bin/python benchmarks/accuracy.py                      # the default path
    .venv/bin/python benchmarks/accuracy.py --path "--kv-cache-dtype int8"
    .venv/bin/python benchmarks/accuracy.py --path "--kv-cache-dtype fp8"
    .venv/bin/python benchmarks/accuracy.py --path "--quantization int8" \\
        --baseline "--quantization none" --contexts 512          # a weight path (issue 21)
    .venv/bin/python benchmarks/accuracy.py --mode prefill \
        --path "--max-num-batched-tokens 256" \
        --baseline "--max-num-batched-tokens 256 --attention-backend torch"  # prompt kernels

Last line: `accuracy: <path> perplexity <x> (bf16 <y>, ratio <r>), top-1 agreement
with fp32 <a>%` (the longest context; with no --path, `<path>` is `default flags (W)`, W
the weights they resolved to on this CPU: gguf-a8 on AVX512-VNNI, gguf-a16 on AVX2). Targets (PERFORMANCE.md, issue 22): within 1%
perplexity of bf16, >= 97% top-1 agreement with fp32.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run as a script too: benchmarks/ as a package
TEXT = HERE.parent / "tests" / "data" / "opticks_book1.txt"


def build_engine(model: str, flags: str):
    from tokenmill.cli.engine_args import add_engine_args, engine_config_from_args
    from tokenmill.engine.core.llm_engine import LLMEngine

    parser = argparse.ArgumentParser(prog="engine flags")
    add_engine_args(parser)
    args = parser.parse_args([model, "--no-prefix-caching", *shlex.split(flags)])
    return LLMEngine(engine_config_from_args(args))


def default_baseline(source) -> str:
    """bf16 KV on the default weights; on gguf-a16 where those are gguf-a8 (AVX512-VNNI:
    tokenmill/quant/default_arithmetic.py), so the ratio on the last line is the
    default's against the baseline it always had."""
    from tokenmill.quant.default_arithmetic import default_gguf_arithmetic

    flags = "--kv-cache-dtype bfloat16"
    if source.kind == "gguf" and default_gguf_arithmetic().method == "gguf-a8":
        flags += " --quantization gguf-a16"
    return flags


def windows_of(ids: list[int], context: int, limit: int | None) -> list[list[int]]:
    out = [ids[i:i + context + 1] for i in range(0, len(ids) - context, context + 1)]
    return out[:limit] if limit else out


def score(model: str, flags: str, windows: list[list[int]], score_last: int | None,
          mode: str = "decode"):
    from tokenmill.engine.core.teacher_forced import score_prompts, score_windows

    engine = build_engine(model, flags)
    t0 = time.perf_counter()
    if mode == "prefill":
        scores = score_prompts(engine, windows)
    else:
        scores = score_windows(engine, windows, score_last)
    described = (f"{engine.dtype}".removeprefix("torch.") + f", weights {engine.quantization}, "
                 f"KV {engine.config.cache.kv_cache_dtype}")
    weights = engine.quantization  # what the flags resolved to (the last line says it)
    del engine
    return scores, described, time.perf_counter() - t0, weights


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--path", default="",
                    help="engine flags of the path under test (default: the default path)")
    ap.add_argument("--baseline", default=None,
                    help="engine flags of the bf16 baseline (default: --kv-cache-dtype "
                    "bfloat16, with --quantization gguf-a16 where a GGUF's default weights "
                    "are gguf-a8: the baseline keeps its activations below bf16's rounding)")
    ap.add_argument("--reference", default="--dtype float32",
                    help="engine flags of the fp32 reference")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--positions", type=int, default=1000,
                    help="positions compared with the fp32 reference, per context")
    ap.add_argument("--max-windows", type=int, default=None,
                    help="score at most this many windows per context (default: all)")
    ap.add_argument("--score-last", type=int, default=None,
                    help="score only the last N positions of each window, the rest its "
                         "prompt (default: every position, each a decode step)")
    ap.add_argument("--mode", choices=["decode", "prefill"], default="decode",
                    help="score each position by a decode step (default) or from one "
                         "prefill of its window (the prompt-attention kernels)")
    ap.add_argument("--output", help="write the figures as JSON")
    ap.add_argument("--kld-chunks", type=int, default=4,
                    help="chunks of 512 tokens for the KL-divergence table (issue 57; "
                    "0: none; the full gate is benchmarks/kld_gate.py)")
    args = ap.parse_args()
    if args.mode == "prefill" and args.score_last:
        ap.error("--score-last applies to --mode decode only (a prefill scores every "
                 "position of its window)")

    from common import machine

    from tokenmill.engine.core.llm_engine import LLMEngine  # noqa: F401  (import cost up front)
    from tokenmill.loaders.model_source import resolve_model
    from tokenmill.loaders.tokenizer import load_tokenizer

    source = resolve_model(args.model)
    if args.baseline is None:
        args.baseline = default_baseline(source)
    tokenizer = load_tokenizer(source)
    ids = tokenizer.encode(Path(args.text).read_text(), add_special_tokens=False)
    print(f"machine: {machine()}")
    print(f"text: {args.text} ({len(ids):,} tokens)")
    results = []
    for context in [int(c) for c in args.contexts.split(",")]:
        windows = windows_of(ids, context, args.max_windows)
        if not windows:
            raise SystemExit(f"the text has {len(ids)} tokens: no window of {context + 1}")
        last = args.score_last
        per_window = min(last, context) if last else context
        ref_windows = windows[:-(-args.positions // per_window)]  # enough for --positions
        path, path_desc, path_s, path_weights = score(args.model, args.path, windows, last,
                                                      args.mode)
        base, base_desc, base_s, _ = score(args.model, args.baseline, windows, last, args.mode)
        ref, ref_desc, ref_s, _ = score(args.model, args.reference, ref_windows, last,
                                        args.mode)
        n_ref = min(args.positions, sum(len(w) for w in ref.argmax))
        row = {
            "context": context, "windows": len(windows), "mode": args.mode,
            "positions": sum(len(w) for w in path.logprobs),
            "path": args.path, "path_weights": path_weights, "path_engine": path_desc,
            "baseline": args.baseline,
            "baseline_engine": base_desc, "reference": args.reference,
            "reference_engine": ref_desc,
            "perplexity": path.perplexity(), "baseline_perplexity": base.perplexity(),
            "top1_vs_reference": path.agreement(ref, n_ref),
            "baseline_top1_vs_reference": base.agreement(ref, n_ref),
            "top1_vs_baseline": path.agreement(base),
            "reference_positions": n_ref, "seconds": [path_s, base_s, ref_s],
        }
        row["perplexity_ratio"] = row["perplexity"] / row["baseline_perplexity"]
        results.append(row)
        print(f"context {context:,}: {row['windows']} windows, {row['positions']:,} positions; "
              f"perplexity {row['perplexity']:.4f} ({path_desc}) vs {row['baseline_perplexity']:.4f} "
              f"({base_desc}), ratio {row['perplexity_ratio']:.4f}; top-1 agreement with fp32 "
              f"({ref_desc}, {n_ref} positions) {100 * row['top1_vs_reference']:.1f}% "
              f"(baseline {100 * row['baseline_top1_vs_reference']:.1f}%), with the baseline "
              f"{100 * row['top1_vs_baseline']:.1f}%  [{path_s:.0f}+{base_s:.0f}+{ref_s:.0f} s]")
    if args.output:
        Path(args.output).write_text(json.dumps({"machine": machine(), "results": results},
                                                indent=2))
    if args.kld_chunks:
        from benchmarks.accuracy_gate.quick import kld_table
        print(kld_table(args.model, args.path, args.kld_chunks))
    for row in results:
        mode = " (prefill)" if args.mode == "prefill" else ""
        # the default path: the flags that give it and the weights they resolved to on
        # this CPU (gguf-a8 on AVX512-VNNI, gguf-a16 on AVX2: default_arithmetic.py)
        label = args.path or f"default flags ({row['path_weights']})"
        print(f"accuracy: {label}{mode} @ {row['context']} perplexity {row['perplexity']:.4f} "
              f"(bf16 {row['baseline_perplexity']:.4f}, ratio {row['perplexity_ratio']:.4f}), "
              f"top-1 agreement with fp32 {100 * row['top1_vs_reference']:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
