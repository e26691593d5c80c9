"""Prefill/decode disaggregation's trade (issue 62): ITL p99 and TTFT of streaming
decodes while long prompts arrive, on the same 2 cores laid out three ways:

  (a) one instance with both cores;
  (b) 1 prefill + 1 decode instance, one core each, behind vllm-router's
      --vllm-pd-disaggregation (--kv-transfer-config kv_producer / kv_consumer);
  (c) two replicas, one core each, behind vllm-router --policy round_robin.

Workload: --concurrency streams (default 8) each asking --decode-tokens (256) new tokens
of a --decode-prompt (128)-token prompt, back to back, while a --long-prompt
(2,048)-token prompt (--long-max-tokens 16 new tokens) arrives every --interval (2 s),
for --duration seconds. Prompts are random token ids, fresh per request (no prefix
cache help). Every process is pinned with sched_setaffinity / taskset: each server (its
engine core inherits it), the router and this client (--client-cpus, default 0), or the
ITL figures are scheduler noise. Reports, per layout: ITL p50/p99 of the decode streams,
their TTFT p50, the long prompts' TTFT p50, output tok/s. Target: (b) ITL p99 <= 1/2 of
(a)'s; the TTFT and throughput it costs are printed beside it.

    python -m benchmarks run pd-trade                         # ~5 min (3 x 60 s + start-ups)
    python -m benchmarks run pd-trade --repeats 3             # ~13 min: medians of 3
    python -m benchmarks run pd-trade --duration 4 --concurrency 2 --decode-tokens 8 \
        --long-prompt 64 --interval 1 --no-result             # smoke, ~1.5 min

The figures go to benchmarks/results/ (one result, every layout's figures; --no-result
skips it); `python -m benchmarks report` then regenerates BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import sys
import time

import httpx

from benchmarks import results
from benchmarks.common import machine
from benchmarks.results import Figure
from benchmarks.server import router_binary, running_router, start_server

ROUTER = router_binary()
MODEL = "smollm2-135m"
VOCAB = 49152


@contextlib.contextmanager
def pinned(cpus: set[int]):
    """Children started inside inherit this affinity (fork keeps it)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _cpus(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def serve(cpus: str, *extra: str):
    threads = str(len(_cpus(cpus)))
    with pinned(_cpus(cpus)):
        return start_server(MODEL, "--max-num-seqs", "16", "--max-model-len", "4096",
                            "--kv-cache-memory", "1GiB", *extra,
                            env={"OMP_NUM_THREADS": threads})


def router(args: list[str], cpus: str):
    return running_router(args, prefix=("taskset", "-c", cpus))


@contextlib.contextmanager
def layout(name: str, args: argparse.Namespace):
    servers = []
    try:
        if name == "a":
            servers.append(serve("0-1"))
            yield servers[0].base_url
            return
        if name == "b":
            servers.append(serve("0", "--kv-transfer-config", '{"kv_role": "kv_producer"}'))
            servers.append(serve("1", "--kv-transfer-config", '{"kv_role": "kv_consumer"}'))
            route = ["--vllm-pd-disaggregation", "--prefill", servers[0].base_url,
                     "--decode", servers[1].base_url, "--policy", "round_robin"]
        else:
            servers += [serve("0"), serve("1")]
            route = ["--policy", "round_robin", "--worker-urls",
                     *[s.base_url for s in servers]]
        with router(route, args.client_cpus) as url:
            yield url
    finally:
        for s in servers:
            s.stop()


async def _stream(client: httpx.AsyncClient, url: str, n_prompt: int, max_tokens: int,
                  rng: random.Random) -> tuple[float, list[float], int]:
    """(TTFT s, token arrival times, tokens) of one streamed completion."""
    body = {"model": MODEL, "prompt": [rng.randrange(VOCAB) for _ in range(n_prompt)],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    return (times[0] - t0 if times else float("nan")), times, len(times)


async def run_load(url: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    end = time.perf_counter() + args.duration
    itl: list[float] = []
    ttft: list[float] = []
    long_ttft: list[float] = []
    tokens = 0
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def decoder() -> None:
            nonlocal tokens
            while time.perf_counter() < end:
                first, times, n = await _stream(client, url, args.decode_prompt,
                                                args.decode_tokens, rng)
                ttft.append(first)
                itl.extend(b - a for a, b in itertools.pairwise(times))
                tokens += n

        async def long_prompts() -> None:
            pending = []
            while time.perf_counter() < end:
                pending.append(asyncio.ensure_future(
                    _stream(client, url, args.long_prompt, args.long_max_tokens, rng)))
                await asyncio.sleep(args.interval)
            for first, _, _ in await asyncio.gather(*pending):
                long_ttft.append(first)

        t0 = time.perf_counter()
        await asyncio.gather(long_prompts(), *(decoder() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0

    def pct(xs: list[float], q: float) -> float:
        return statistics.quantiles(xs, n=100)[q - 1] * 1e3 if len(xs) >= 2 else float("nan")

    return {"itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            "ttft_p50_ms": pct(ttft, 50), "long_ttft_p50_ms": pct(long_ttft, 50),
            "out_tok_s": tokens / wall, "decodes": len(ttft), "long": len(long_ttft)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--long-prompt", type=int, default=2048)
    ap.add_argument("--long-max-tokens", type=int, default=16)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--client-cpus", default="0", help="this client's and the router's CPUs")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each layout (in turn: a b c a b c ...); medians reported")
    ap.add_argument("--no-result", action="store_true",
                    help="do not write the result to benchmarks/results/")
    args = ap.parse_args(argv)
    if ROUTER is None and set(args.layouts) - {"a"}:
        sys.exit("vllm-router is not installed: pip install vllm-router==0.1.17")
    print(f"PD trade · {machine()} · client+router on CPUs {args.client_cpus}")
    os.sched_setaffinity(0, _cpus(args.client_cpus))
    print("layout                         ITL p50  ITL p99  TTFT p50  long TTFT p50  out tok/s")
    runs: dict[str, list[dict]] = {name: [] for name in args.layouts}
    for _ in range(args.repeats):
        for name in args.layouts:
            with pinned(set(range(os.cpu_count() or 1))), layout(name, args) as url:
                os.sched_setaffinity(0, _cpus(args.client_cpus))
                r = asyncio.run(run_load(url, args))
            runs[name].append(r)
            print(f"{NAMES[name]:30s} {r['itl_p50_ms']:7.1f} {r['itl_p99_ms']:8.1f} "
                  f"{r['ttft_p50_ms']:9.0f} {r['long_ttft_p50_ms']:14.0f} "
                  f"{r['out_tok_s']:10.1f}", flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in METRICS}
           for name, rs in runs.items()}
    notes = [(f"workload: c={args.concurrency} streams of {args.decode_tokens} new tokens "
             f"({args.decode_prompt}-token prompts) while a {args.long_prompt}-token prompt "
             f"arrives every {args.interval:g} s, {args.duration:g} s per run; servers pinned "
             f"one core each ((b), (c)) or both ((a)); client and router on CPUs "
             f"{args.client_cpus}")]
    if "a" in med and "b" in med:
        ratio = med["b"]["itl_p99_ms"] / med["a"]["itl_p99_ms"]
        line = f"(b)/(a) ITL p99: {ratio:.2f} (target <= 0.50)"
        for key, what in (("ttft_p50_ms", "TTFT p50"), ("long_ttft_p50_ms", "long TTFT p50"),
                          ("out_tok_s", "output tok/s")):
            line += f"; {what} {med['b'][key] / med['a'][key]:.2f}x"
        print(line)
        notes.append(line)
    if not args.no_result:
        figures = [Figure(NAMES[name], "tokenmill", metric, unit, [r[key] for r in rs],
                          higher, {"model": MODEL, "layout": name})
                   for name, rs in runs.items()
                   for key, (metric, unit, higher) in METRICS.items()
                   if all(r[key] == r[key] for r in rs)]  # NaN: too few samples
        print(results.write(results.build("pd-trade", "PD disaggregation's trade", figures,
                                          notes=notes)))


NAMES = {"a": "(a) 1 instance, 2 cores", "b": "(b) 1P + 1D, 1 core each",
         "c": "(c) 2 replicas, round robin"}
# result key -> (metric, unit, higher is better)
METRICS = {"itl_p50_ms": ("ITL p50", "ms", False), "itl_p99_ms": ("ITL p99", "ms", False),
           "ttft_p50_ms": ("TTFT p50", "ms", False),
           "long_ttft_p50_ms": ("long-prompt TTFT p50", "ms", False),
           "out_tok_s": ("output throughput", "tok/s", True)}


if __name__ == "__main__":
    main()
