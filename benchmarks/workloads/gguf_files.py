"""Issue 56: each GGUF file a user has, tokenmill's default path against llama.cpp on the
same file, one run. Per file: batch-1 decode (a 128-token prompt of random ids, 128 new
tokens, TPOT medians of --repeats) vs `llama-bench -p 0 -n 128` (tg128, 2 threads);
prompt processing (one 512-token prompt, TTFT) vs `llama-bench -p 512 -n 0`; the
in-process engine's RSS after the runs beside the file's bytes; and the weight forms
the engine logged (which GGUF types run natively, in which record form, float copies).

    .venv/bin/python -m benchmarks.workloads.gguf_files                       # the peers' files
    .venv/bin/python -m benchmarks.workloads.gguf_files FILE.gguf ... --skip-peers

Default files: the embedded Q4_1, then ~/.cache/tokenmill-peers/models/smollm2-135m-
{Q4_K_M,Q5_K_M,Q6_K,Q8_0}.gguf and llama-1b-random-Q4_K_M.gguf where they exist
(benchmarks/peers/ makes them). Each file runs in its own process (RSS of its own).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import embedded_gguf, machine, median_spread
from benchmarks.peers import add_peer_args, ensure_llama_cpp, run_llama_bench, selected_peers, skip

MODELS = Path.home() / ".cache" / "tokenmill-peers" / "models"
DEFAULT_FILES = ["smollm2-135m-Q4_K_M.gguf", "smollm2-135m-Q5_K_M.gguf",
                 "smollm2-135m-Q6_K.gguf", "smollm2-135m-Q8_0.gguf",
                 "llama-1b-random-Q4_K_M.gguf"]


def measure(path: str, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    """In this process: decode TPOT, prefill TTFT, RSS and the weight forms."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(path, enable_prefix_caching=False)
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    decode_prompt = [rng.randrange(100, vocab) for _ in range(128)]
    long_prompt = [rng.randrange(100, vocab) for _ in range(prompt_len)]
    llm.generate([decode_prompt], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    tpots, ttfts = [], []
    for _ in range(repeats):
        m = llm.generate([decode_prompt], params, use_tqdm=False)[0].metrics
        tpots.append(1e3 * (m.finished_time - m.first_token_time) / (new_tokens - 1))
        m = llm.generate([long_prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0].metrics
        ttfts.append(1e3 * (m.first_token_time - m.arrival_time))
    status = Path("/proc/self/status").read_text().splitlines()
    rss = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))
    return {"tpot_ms": tpots, "prefill_ms": ttfts, "rss_bytes": rss,
            "fused": llm.engine.runner.fused_decode is not None,
            "weights": getattr(llm.engine.runner.model, "weight_forms", None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="GGUF files (default: see the module docstring)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-repetitions", type=int, default=5)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one file
    add_peer_args(ap, ("llama",))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.prompt_len, args.new_tokens, args.repeats)))
        return
    files = args.files or [str(embedded_gguf())] + [
        str(MODELS / f) for f in DEFAULT_FILES if (MODELS / f).exists()]
    llama = None
    if "llama" in selected_peers(args, ("llama",)):
        llama, why = ensure_llama_cpp()
        if llama is None:
            skip("llama.cpp", why)
    print(f"GGUF files, tokenmill default vs llama.cpp · {machine()}")
    for path in files:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.workloads.gguf_files", "--one", path, "--prompt-len", str(args.prompt_len),
             "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)],
            check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        tpot, pre = statistics.median(r["tpot_ms"]), statistics.median(r["prefill_ms"])
        size = os.path.getsize(path)
        print(f"\n{Path(path).name} ({size / 2**20:.0f} MiB)")
        print(f"  tokenmill decode TPOT {median_spread(r['tpot_ms'])} ms = {1e3 / tpot:.1f} "
              f"tok/s ({'fused decode step' if r['fused'] else 'module path'}); "
              f"pp{args.prompt_len} {args.prompt_len * 1e3 / pre:.0f} tok/s; "
              f"RSS {r['rss_bytes'] / 2**20:.0f} MiB")
        w = r["weights"] or {}
        for cls, forms in w.get("linears", {}).items():
            print(f"    {cls}: " + ", ".join(f"{f} x{n}" for f, n in forms.items()))
        print(f"    records {w.get('lowbit_bytes', 0) / 2**20:.0f} MiB, float copies "
              f"{w.get('float_copy_bytes', 0) / 2**20:.0f} MiB, embedding "
              f"{w.get('embedding')}, kept float: {len(w.get('kept_float', {}))}")
        if llama is not None:
            tg = run_llama_bench(llama, Path(path), 0, args.new_tokens,
                                 repetitions=args.llama_repetitions)
            pp = run_llama_bench(llama, Path(path), args.prompt_len, 0,
                                 repetitions=args.llama_repetitions)
            print(f"  llama-bench tg{args.new_tokens} {tg['tok_s']:.1f} tok/s -> ratio "
                  f"{1e3 / tpot / tg['tok_s']:.2f}x; pp{args.prompt_len} {pp['tok_s']:.0f} "
                  f"tok/s -> ratio {args.prompt_len * 1e3 / pre / pp['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
