"""Data parallel behind vllm-router: 2 tokenmill replicas x 1 thread, by routing policy.

Part 1 (W5-style, 4 and then 16 distinct prefixes): 64 requests, each one of N distinct
1,024-token prefixes plus a distinct 64-token suffix, 64 output tokens,
concurrency 16, through `vllm-router --policy kv_aware | cache_aware |
round_robin` over two `tokenmill serve` replicas (OMP_NUM_THREADS=1 each, KV
events on for kv_aware). Replicas restart per policy, so every policy starts
cold. Reports each policy's prefix-cache hit rate (from the replicas' own
/metrics: hits / queries over the run) and the client's TTFT p50.
Part 2 (W2, concurrency 16): 1 replica x 2 threads vs 2 replicas x 1 thread
behind round_robin, output tok/s and TTFT p50.

    python -m benchmarks run data-parallel          # needs vllm-router==0.1.17
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
from benchmarks.common import machine
from benchmarks.server import free_port, router_binary, running_router, start_server

W2_PROMPTS = HERE.parents[2] / "shared" / "data" / "w2_prompts_128.json"
ROUTER = router_binary()


def _counter(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(f"tokenmill:{name}_total"))


@contextlib.contextmanager
def replicas(n: int, threads: int, kv_events: bool):
    servers, ports = [], []
    try:
        for _ in range(n):
            args = ["smollm2-135m", "--max-num-seqs", "32"]
            if kv_events:
                ports.append(free_port())
                args += ["--kv-events-config", json.dumps(
                    {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{ports[-1]}"})]
            servers.append(start_server(*args, env={"OMP_NUM_THREADS": str(threads)}))
        yield servers, ports
    finally:
        for s in servers:
            s.stop()


def router(servers, policy: str, event_ports: list[int]):
    args = ["--policy", policy, "--worker-urls", *[s.base_url for s in servers]]
    if event_ports:
        args += ["--kv-event-block-size", "16", "--kv-event-model", "smollm2-135m"]
        for s, p in zip(servers, event_ports):
            args += ["--kv-event-source", f"{s.base_url}=tcp://127.0.0.1:{p}"]
    return running_router(args)


def bench(base_url: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "--base-url", base_url,
               "--model", "smollm2-135m", "--output", str(out), "--no-progress", *extra]
        print("$ tokenmill " + " ".join(cmd[3:]), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
        return (result.get("runs") or [result])[0]["summary"]  # one level: no "runs"


def prefix_policies(args, num_prefixes: int) -> None:
    workload = ["--dataset", "prefix", "--num-prefixes", str(num_prefixes), "--prefix-len", "1024",
                "--input-len", "64", "--output-len", "64", "--num-requests",
                str(args.num_requests), "--concurrency", "16", "--seed", "0"]
    print(f"\n{num_prefixes} distinct prefixes")
    print("policy        hit rate   TTFT p50   out tok/s   requests per replica")
    for policy in args.policies:
        with replicas(2, 1, kv_events=policy == "kv_aware") as (servers, ports), \
                router(servers, policy, ports if policy == "kv_aware" else []) as url:
            q0 = [_counter(s.base_url, "prefix_cache_queries") for s in servers]
            h0 = [_counter(s.base_url, "prefix_cache_hits") for s in servers]
            r0 = [_counter(s.base_url, "request_success") for s in servers]
            s = bench(url, workload)
            q = sum(_counter(x.base_url, "prefix_cache_queries") for x in servers) - sum(q0)
            h = sum(_counter(x.base_url, "prefix_cache_hits") for x in servers) - sum(h0)
            per = [int(_counter(x.base_url, "request_success") - r)
                   for x, r in zip(servers, r0)]
        print(f"{policy:12s} {h / max(q, 1):8.1%} {s['ttft_ms']['p50']:8.0f} ms "
              f"{s['output_throughput_tok_s']:9.1f}   {per}", flush=True)


def w2_layouts(args) -> None:
    workload = ["--dataset", "jsonl", "--dataset-path", str(W2_PROMPTS), "--output-len", "128",
                "--num-requests", str(args.num_requests), "--concurrency", "16"]
    print("\nW2 c=16            out tok/s   TTFT p50")
    with replicas(1, 2, kv_events=False) as (servers, _):
        s = bench(servers[0].base_url, workload)
    print(f"1 replica x 2 thr  {s['output_throughput_tok_s']:9.1f} {s['ttft_ms']['p50']:8.0f} ms")
    with replicas(2, 1, kv_events=False) as (servers, _), router(servers, "round_robin", []) as u:
        s = bench(u, workload)
    print(f"2 replicas x 1 thr {s['output_throughput_tok_s']:9.1f} {s['ttft_ms']['p50']:8.0f} ms")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--policies", nargs="+", default=["kv_aware", "cache_aware", "round_robin"])
    ap.add_argument("--skip-w2", action="store_true")
    ap.add_argument("--num-prefixes", type=int, nargs="*", default=[4, 16],
                    help="distinct 1,024-token prefixes, one part-1 run per value "
                         "(none: skip part 1)")
    args = ap.parse_args(argv)
    if ROUTER is None:
        sys.exit("vllm-router is not installed: pip install vllm-router==0.1.17")
    print(f"data parallel behind vllm-router · {machine()}")
    for n in args.num_prefixes:
        prefix_policies(args, n)
    if not args.skip_w2:
        w2_layouts(args)


if __name__ == "__main__":
    main()
