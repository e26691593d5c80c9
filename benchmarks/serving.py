"""W2 online serving (PERFORMANCE.md): `tokenmill serve` under `tokenmill bench`.

Starts `tokenmill serve smollm2-135m` (defaults: the embedded GGUF, the engine's own
fastest path) on 127.0.0.1 and runs `tokenmill bench` over it: 64 streaming
/v1/completions requests per concurrency level (1, 4, 16, 32), each level on the
next 64 prompts of ../shared/data/w2_prompts_128.json (exactly 128 tokens each,
all different), max_tokens 128 with ignore_eos. Prints TTFT p50/p99, TPOT mean and
output tok/s per level beside llama-server's figures. llama.cpp is not installed
here and cannot be built, so those are the numbers PERFORMANCE.md records as
measured on this machine (`llama-server -t 2 -np 16`, `-np 32` at 32), not re-run.

    .venv/bin/python benchmarks/serving.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import machine
from serving import start_server

W2_PROMPTS = HERE.parent.parent / "shared" / "data" / "w2_prompts_128.json"

# PERFORMANCE.md, llama-server on this machine: concurrency -> (out tok/s, TTFT p50 ms,
# TTFT p99 ms, TPOT mean ms); None where it records no figure
LLAMA_SERVER = {1: (123.0, 262.0, None, 6.1), 4: (150.0, 1050.0, None, None),
                16: (189.0, 4300.0, None, 51.0), 32: (202.0, 4300.0, 8200.0, 112.0)}


def run_bench(base_url: str, levels: list[int], num_requests: int, output_len: int,
              out_path: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "--base-url", base_url,
           "--dataset", "jsonl", "--dataset-path", str(W2_PROMPTS),
           "--output-len", str(output_len), "--num-requests", str(num_requests),
           "--sweep", "concurrency=" + ",".join(map(str, levels)),
           "--output", str(out_path), "--no-progress"]
    print("$ tokenmill " + " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out_path.read_text())
    return [r["summary"] for r in result["runs"]]


def ratio(ours: float, theirs: float | None, higher_is_better: bool) -> str:
    if theirs is None:
        return "    —"
    return f"{(ours / theirs if higher_is_better else theirs / ours):5.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,4,16,32", help="comma-separated levels")
    ap.add_argument("--num-requests", type=int, default=64, help="requests per level")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output", default=None, help="keep the bench JSON here")
    ap.add_argument("serve_args", nargs="*", help="extra `tokenmill serve` flags (after --)")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    print(f"W2 online serving · {machine()}")
    server = start_server("smollm2-135m", *args.serve_args)
    try:
        # warm-up outside the measured prompts, so that each level's prompts stay fresh
        httpx.post(f"{server.base_url}/v1/completions", timeout=300, json={
            "model": "smollm2-135m", "prompt": "Hello", "max_tokens": 8})
        out_path = Path(args.output or tempfile.mktemp(suffix=".json", prefix="w2-"))
        summaries = run_bench(server.base_url, levels, args.num_requests, args.output_len,
                              out_path)
    finally:
        server.stop()
    print(f"bench JSON: {out_path}")
    print("llama-server columns are PERFORMANCE.md's recorded figures (measured on this "
          "machine, not re-run here: llama.cpp is not installed); ratio > 1 = tokenmill better")
    print(f"{'conc':>4} | {'out tok/s':>9} {'llama':>6} {'ratio':>6} | {'TTFT p50':>9} "
          f"{'llama':>6} {'ratio':>6} | {'TTFT p99':>9} {'llama':>6} | {'TPOT':>7} "
          f"{'llama':>6} {'ratio':>6} | failed")
    for c, s in zip(levels, summaries):
        tok_s, ttft50, ttft99, tpot = (s["output_throughput_tok_s"], s["ttft_ms"]["p50"],
                                       s["ttft_ms"]["p99"], s["tpot_ms"]["mean"])
        peer = LLAMA_SERVER.get(c, (None, None, None, None))
        fmt = lambda v: "—" if v is None else f"{v:.0f}"
        print(f"{c:>4} | {tok_s:9.1f} {fmt(peer[0]):>6} {ratio(tok_s, peer[0], True):>6} | "
              f"{ttft50:7.0f}ms {fmt(peer[1]):>6} {ratio(ttft50, peer[1], False):>6} | "
              f"{ttft99:7.0f}ms {fmt(peer[2]):>6} | {tpot:5.1f}ms {fmt(peer[3]):>6} "
              f"{ratio(tpot, peer[3], False):>6} | {s['num_failed']}")
    if 16 in levels:
        s = summaries[levels.index(16)]
        tok_s, ttft50 = s["output_throughput_tok_s"], s["ttft_ms"]["p50"]
        ok = tok_s >= 3 * LLAMA_SERVER[16][0] and ttft50 <= LLAMA_SERVER[16][1] / 3
        print(f"target at concurrency 16: >= {3 * LLAMA_SERVER[16][0]:.0f} output tok/s and "
              f"TTFT p50 <= {LLAMA_SERVER[16][1] / 3:.0f} ms -> {tok_s:.0f} tok/s, "
              f"{ttft50:.0f} ms: {'met' if ok else 'missed'}")


if __name__ == "__main__":
    main()
