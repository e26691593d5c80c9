"""The load generator's own ceiling: streamed events/s that `tokenmill bench` ingests
with 1 and N `--workers`, against the test suite's stub SSE server
(tests/bench/fakes.py) writing pre-made one-token chunks as fast as it can, in
processes of its own.

Two figures per worker count:
- saturated: every stream unpaced; events/s ingested (content chunks / duration) and
  the event loop's lag (how late a 5 ms sleep woke, p99 over all workers);
- under 1 ms: the offered rate is raised (more paced streams, 8 events every 5 ms each)
  until the loop lag (p99, or p50 with --lag-stat p50) reaches 1 ms; the highest
  events/s ingested below that.

    .venv/bin/python benchmarks/client_ceiling.py --workers 1 2 4 --server-procs 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tests.bench.fakes import WordTokenizer
from tests.serving import free_port
from tokenmill.bench import runner
from tokenmill.bench.client import ClientOptions
from tokenmill.bench.workload import BenchRequest


def start_stub(procs: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.bench.fakes", str(port), str(procs)],
                            cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("stub server did not start")


def measure(url: str, workers: int, streams: int, tokens: int, burst: int,
            gap_ms: float) -> dict:
    opts = ClientOptions(base_url=url, model="fake",
                         extra_body={"fake": {"burst": burst, "gap_ms": gap_ms}})
    target = runner.HttpTarget(opts, WordTokenizer(), workers=workers)
    reqs = [BenchRequest("p", 1, tokens) for _ in range(streams)]
    plan = runner.BenchPlan(target, {"model": "fake"}, lambda i: reqs)
    res = runner.run_once(plan, runner.LoadSpec(concurrency=streams))
    s, c = res["summary"], res["client"]
    events = sum(len(r["chunk_times_s"]) for r in res["requests"])
    return {"workers": workers, "streams": streams, "gap_ms": gap_ms,
            "events_s": events / s["duration_s"], "failed": s["num_failed"],
            "lag_p50_ms": c["loop_lag_ms"]["p50"], "lag_p99_ms": c["loop_lag_ms"]["p99"], "lag_max_ms": c["loop_lag_ms"]["max"],
            "cpu_share": c["cpu_share"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--server-procs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2000, help="chunks per stream")
    ap.add_argument("--burst", type=int, default=8, help="events per server write")
    ap.add_argument("--lag-stat", choices=["p50", "p99"], default="p99",
                    help="the loop-lag statistic that must stay under 1 ms (default p99)")
    args = ap.parse_args()
    proc, url = start_stub(args.server_procs)
    try:
        for w in args.workers:
            sat = measure(url, w, streams=16 * w, tokens=args.tokens, burst=args.burst,
                          gap_ms=0)
            print(f"workers {w}: saturated {sat['events_s']:,.0f} events/s, loop lag p50 "
                  f"{sat['lag_p50_ms']:.2f} / p99 {sat['lag_p99_ms']:.2f} ms, client "
                  f"{100 * sat['cpu_share']:.0f}% of the machine", flush=True)
            best = None
            # each paced stream offers burst events every 5 ms; double the streams
            for streams in (w * 2 ** k for k in range(10)):
                m = measure(url, w, streams=streams, tokens=args.tokens // 4,
                            burst=args.burst, gap_ms=5.0)
                print(f"  workers {w}, {streams} paced streams: {m['events_s']:,.0f} events/s,"
                      f" loop lag p50 {m['lag_p50_ms']:.2f} / p99 {m['lag_p99_ms']:.2f} ms",
                      flush=True)
                if m["failed"] or m[f"lag_{args.lag_stat}_ms"] >= 1.0:
                    break
                best = m
            if best:
                print(f"workers {w}: {best['events_s']:,.0f} events/s with loop lag "
                      f"{args.lag_stat} {best[f'lag_{args.lag_stat}_ms']:.2f} ms < 1 ms "
                      f"({best['streams']} paced streams)", flush=True)
            else:
                print(f"workers {w}: even {w} paced stream(s) lag {args.lag_stat} >= 1 ms",
                      flush=True)
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
