"""Soak: `tokenmill serve` at saturation for --duration seconds (issue 23).

W2-style mixed lengths at concurrency 32 (prompts of 16-512 words, log-uniform;
16-160 output tokens, around W2's 128/128), with 10% of requests disconnecting mid-stream and 5%
invalid. Reports requests and errors by kind; RSS summed over the server's
process tree (front end, engine, workers), open fds and threads at 1, 5 and 10
minutes (and the end); KV usage once the load stops.

    python -m benchmarks run soak --duration 600           # starts its own server
    python -m benchmarks run soak --base-url http://127.0.0.1:8000 --server-pid PID

Not part of `make test`; the figures go to benchmarks/results/ (schema 1: `soak`, or
`soak-<variant>` with --variant; --no-result to skip) and from there to BENCHMARKS.md.
Pass criteria printed at the end: 0 unexpected errors, KV usage 0, RSS growth over the last half <= 2%
(the server it starts pre-touches its KV pool, --kv-cache-prefault, so RSS is flat
once warm; RSS net of the KV pool's touched bytes is held to the same 2% either way).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import random
import time
from pathlib import Path

import httpx
import psutil

from benchmarks.features.soak_mix import mixed_request

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
         "seven", "wizards", "quietly", "hex", "every", "jolly", "mountain", "river"]
INVALID = [  # each must come back as a 4xx with an error object
    {"prompt": "hi", "temperature": -1},
    {"prompt": "hi", "seed": -5},
    {"prompt": "hi", "stop": "x" * 100_000},
    {"prompt": "hi", "n": 1000},
    {"prompt": []},
    {"prompt": "hi", "max_tokens": 10**7},
]
CHECKPOINTS_S = (60, 120, 180, 240, 300, 360, 420, 480, 540, 600)
PRINTED_S = (0, 60, 300, 600)


def tree_usage(pid: int) -> dict[str, float]:
    """RSS (MiB), fds and threads summed over a process and its descendants."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    rss = fds = threads = 0
    per_process = {}
    for proc in procs:
        try:
            one = proc.memory_info().rss
            fds += proc.num_fds()
            threads += proc.num_threads()
        except psutil.NoSuchProcess:
            continue
        rss += one
        per_process[f"{proc.pid} {_role(proc)}"] = round(one / 2**20)
    return {"rss_mib": rss / 2**20, "fds": fds, "threads": threads, "processes": len(procs),
            "rss_mib_by_process": per_process}


def _role(proc: psutil.Process) -> str:
    """front end / engine core / a worker, from the command line."""
    with contextlib.suppress(psutil.Error):
        cmd = " ".join(proc.cmdline())
        for needle, role in (("core_process", "engine core"), ("executor.worker", "worker"),
                             ("serve", "front end")):
            if needle in cmd:
                return role
    return "other"


def prompt_of(rng: random.Random) -> tuple[str, int]:
    num_words = int(math.exp(rng.uniform(math.log(16), math.log(512))))
    text = " ".join(rng.choice(WORDS) for _ in range(num_words))
    return text, rng.randint(16, 160)


async def one_request(client: httpx.AsyncClient, rng: random.Random,
                      counts: collections.Counter) -> None:
    roll = rng.random()
    if roll < 0.05:
        r = await client.post("/v1/completions", json=rng.choice(INVALID))
        ok = 400 <= r.status_code < 500 and "error" in r.json()
        counts["invalid: 4xx as expected" if ok else f"invalid: unexpected {r.status_code}"] += 1
        return
    if roll >= 0.55:  # issue 64's mix: structured, tools, n=2 + logprobs, shared prefixes
        await mixed_request(client, rng, WORDS, counts)
        return
    prompt, max_tokens = prompt_of(rng)
    disconnect_after = rng.randint(1, max_tokens // 2) if roll < 0.15 else None
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0.8}
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            counts[f"unexpected {r.status_code}: {r.text[:80]}"] += 1
            return
        async for line in r.aiter_lines():
            if line.startswith('data: {"error"'):
                counts[f"stream error: {line[6:120]}"] += 1
                return
            if line.startswith("data: {"):
                chunks += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    counts["disconnected mid-stream (on purpose)"] += 1
                    return
            elif line == "data: [DONE]":
                counts["completed"] += 1
                return
    counts["stream ended without [DONE]"] += 1


async def client_loop(base_url: str, headers: dict, seed: int, deadline: float,
                      counts: collections.Counter, timeout_s: float = 300.0) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, headers=headers,
                                 timeout=timeout_s) as client:
        while time.monotonic() < deadline:
            try:
                await one_request(client, rng, counts)
            except httpx.HTTPError as e:
                counts[f"transport error: {type(e).__name__}"] += 1
            except asyncio.CancelledError:  # the deadline: the client leaves mid-request
                counts["in flight at the deadline (cut)"] += 1
                raise


async def sampler(pid: int, start: float, deadline: float, samples: list,
                  base_url: str, headers: dict) -> None:
    # every minute however long the run (a 30-minute soak's last 10 minutes included)
    pending = [c for c in range(60, int(deadline - start) + 1, 60) if start + c < deadline]
    while pending:
        await asyncio.sleep(max(0.0, start + pending[0] - time.monotonic()))
        usage = tree_usage(pid)
        usage["kv_committed_mib"] = await asyncio.to_thread(kv_committed_mib, base_url, headers)
        samples.append((pending.pop(0), usage))


def kv_committed_mib(base_url: str, headers: dict) -> float:
    """The KV pool's bytes ever used (tokenmill:kv_cache_committed_bytes), in MiB."""
    text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=30).text
    for line in text.splitlines():
        if not line.startswith("#") and "kv_cache_committed_bytes" in line:
            return float(line.rsplit(" ", 1)[1]) / 2**20
    return -1.0


def kv_usage(base_url: str, headers: dict) -> tuple[float, float]:
    text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=30).text
    values = {}
    for line in text.splitlines():
        if not line.startswith("#") and ("kv_cache_usage_perc" in line
                                         or "num_requests_running" in line):
            values[line.split("{")[0].split(":")[-1]] = float(line.rsplit(" ", 1)[1])
    return values.get("kv_cache_usage_perc", -1.0), values.get("num_requests_running", -1.0)


async def soak(base_url: str, pid: int, duration_s: float, concurrency: int,
               headers: dict, timeout_s: float = 300.0) -> dict:
    counts: collections.Counter = collections.Counter()
    samples: list = []
    start = time.monotonic()
    deadline = start + duration_s
    samples.append((0, {**tree_usage(pid), "kv_committed_mib": kv_committed_mib(base_url,
                                                                              headers)}))
    tasks = [asyncio.create_task(client_loop(base_url, headers, seed, deadline, counts,
                                                       timeout_s))
             for seed in range(concurrency)]
    tasks.append(asyncio.create_task(sampler(pid, start, deadline, samples, base_url,
                                             headers)))
    await asyncio.sleep(duration_s)
    end_usage = tree_usage(pid)  # still under load
    end_usage["kv_committed_mib"] = kv_committed_mib(base_url, headers)
    samples.append((round(time.monotonic() - start), end_usage))
    for task in tasks:  # a long request would otherwise run on past the deadline
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = time.monotonic() - start
    idle_deadline = time.monotonic() + 30
    usage, running = kv_usage(base_url, headers)
    while (usage or running) and time.monotonic() < idle_deadline:
        await asyncio.sleep(0.5)
        usage, running = kv_usage(base_url, headers)
    after = tree_usage(pid)
    return {"duration_s": round(elapsed, 1), "concurrency": concurrency,
            "requests": sum(counts.values()), "outcomes": dict(counts.most_common()),
            "usage": [{"at_s": at, **u} for at, u in samples],
            "usage_after": after,
            "kv_cache_usage_after": usage, "running_after": running}


def verdict(result: dict) -> list[str]:
    expected = {"completed", "disconnected mid-stream (on purpose)", "invalid: 4xx as expected",
                "in flight at the deadline (cut)"}
    problems = [f"{n} x {kind}" for kind, n in result["outcomes"].items()
                if kind not in expected and not kind.endswith(": ok")]
    if result["kv_cache_usage_after"] != 0:
        problems.append(f"KV usage {result['kv_cache_usage_after']} after the load")
    usage = result["usage"]
    half = last_window(result)
    if len(half) >= 2:
        # net of the KV pool's first touches (all at start-up with --kv-cache-prefault)
        first, last = (u["rss_mib"] - max(u["kv_committed_mib"], 0) for u in (half[0], half[-1]))
        if last > 1.02 * first:
            problems.append(f"RSS net of the KV pool grew {first:.0f} -> {last:.0f} MiB over "
                            "the second half")
        if result.get("prefault") and half[-1]["rss_mib"] > 1.02 * half[0]["rss_mib"]:
            problems.append(f"RSS grew {half[0]['rss_mib']:.0f} -> {half[-1]['rss_mib']:.0f} "
                            "MiB over the second half")
    if len(usage) >= 3 and (usage[-1]["fds"] > usage[1]["fds"] + 4
                            or usage[-1]["threads"] > usage[1]["threads"] + 4):
        problems.append("fds or threads grew after warm-up")
    return problems


def last_window(result: dict) -> list[dict]:
    """The samples of the last 10 minutes (or the second half of a shorter run)."""
    return [u for u in result["usage"] if u["at_s"] >= max(result["duration_s"] / 2,
                                                           result["duration_s"] - 600)]


def record(result: dict, problems: list[str], server_args: list[str],
           variant: str | None) -> None:
    """The run as a schema-1 result: counts, the last window's RSS and its growth, fds and
    threads after warm-up and at the end, KV usage once idle; the verdict in the notes."""
    from benchmarks import results

    expected = ("completed", "disconnected mid-stream (on purpose)",
                "invalid: 4xx as expected", "in flight at the deadline (cut)")
    unexpected = sum(n for kind, n in result["outcomes"].items()
                     if kind not in expected and not kind.endswith(": ok"))
    window = last_window(result)
    first, last = window[0], window[-1]
    usage = result["usage"]
    warm = usage[1] if len(usage) > 1 else usage[0]
    config = {"duration_s": result["duration_s"], "concurrency": result["concurrency"],
              "client_timeout_s": result.get("client_timeout_s", 300.0),
              "server_args": " ".join(server_args) or "(defaults)",
              "window_s": f"{first['at_s']}-{last['at_s']}"}

    def fig(label: str, metric: str, unit: str, value: float, higher: bool = False):
        return results.Figure(label, "tokenmill", metric, unit, [float(value)], higher, config)

    def net(u: dict) -> float:  # net of the KV pool's first touches
        return u["rss_mib"] - max(u["kv_committed_mib"], 0)

    figures = [
        fig("requests", "requests", "count", result["requests"], True),
        fig("unexpected outcomes", "unexpected outcomes", "count", unexpected),
        fig("RSS at the window's start", "tree RSS, window start", "MiB", first["rss_mib"]),
        fig("RSS at the window's end", "tree RSS, window end", "MiB", last["rss_mib"]),
        fig("RSS growth over the window", "tree RSS growth", "%",
            100 * (last["rss_mib"] / first["rss_mib"] - 1)),
        fig("RSS net of the KV pool, growth over the window", "net RSS growth", "%",
            100 * (net(last) / net(first) - 1)),
        fig("KV usage after the load", "KV usage after", "%",
            100 * result["kv_cache_usage_after"]),
        fig("fds after warm-up", "fds, 1 min", "count", warm["fds"]),
        fig("fds at the end", "fds, end", "count", last["fds"]),
        fig("threads after warm-up", "threads, 1 min", "count", warm["threads"]),
        fig("threads at the end", "threads, end", "count", last["threads"]),
    ]
    notes = ["PASS" if not problems else "FAIL: " + "; ".join(problems),
             "outcomes: " + ", ".join(f"{kind} {n}" for kind, n in result["outcomes"].items()),
             "RSS by process (MiB), first sample -> last under load: " + ", ".join(
                 f"{name.split(' ', 1)[1]} {usage[0]['rss_mib_by_process'].get(name, 0)} -> {mib}"
                 for name, mib in usage[-1]["rss_mib_by_process"].items()),
             "tree RSS (MiB) by sample, at_s:MiB: " + " ".join(
                 f"{u['at_s']}:{u['rss_mib']:.0f}" for u in usage),
             ("RSS is summed over the server's process tree (front end + engine core); the "
              "window is the last 10 minutes of load (the second half of a shorter run)")]
    results.write(results.build("soak", "Soak: serve at c=32 with the issue-64 mix",
                                figures, variant=variant, notes=notes))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--base-url", default=None, help="a running server (else one is started)")
    ap.add_argument("--server-pid", type=int, default=None, help="its pid, with --base-url")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("--no-prefault", action="store_true",
                    help="start the server without --kv-cache-prefault (RSS then climbs "
                         "while the KV pool is touched for the first time)")
    ap.add_argument("--client-timeout", type=float, default=300.0,
                    help="each client's httpx timeout in seconds (a read with no byte for "
                         "this long is a transport error); raise it on a loaded machine, "
                         "where at c=32 a request can wait minutes")
    ap.add_argument("--variant", default=None,
                    help="the result's name suffix (soak-VARIANT), e.g. int8-kv")
    ap.add_argument("--no-result", action="store_true",
                    help="print only; write no benchmarks/results/ file")
    ap.add_argument("server_args", nargs="*", help="extra `tokenmill serve` arguments "
                    "(after --: -- --kv-cache-dtype int8)")
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server = None
    if args.base_url is None:
        from benchmarks.server import start_server

        # the pool pre-touched, so a flat RSS means no leak rather than "the KV pool
        # happens to be fully touched by now" (--no-prefault to watch it fill instead)
        prefault = [] if args.no_prefault else ["--kv-cache-prefault"]
        server = start_server(args.model, "--max-num-seqs", str(args.concurrency),
                              *prefault, *args.server_args)
        base_url, pid = server.base_url, server.proc.pid
    else:
        if args.server_pid is None:
            ap.error("--base-url needs --server-pid (to read the process tree's RSS)")
        base_url, pid = args.base_url, args.server_pid
    try:
        result = asyncio.run(soak(base_url, pid, args.duration, args.concurrency, headers,
                                      args.client_timeout))
        result["prefault"] = server is not None and not args.no_prefault
        result["client_timeout_s"] = args.client_timeout
    finally:
        if server is not None:
            server.stop()
    print(f"soak: {result['duration_s']} s at c={result['concurrency']}, "
          f"{result['requests']} requests")
    for kind, n in result["outcomes"].items():
        print(f"  {n:6d}  {kind}")
    print("   at_s  RSS MiB  KV touched MiB  fds  threads  processes")
    usage = result["usage"]
    for u in usage:
        if u["at_s"] in PRINTED_S or u is usage[-1]:
            print(f"  {u['at_s']:5d}  {u['rss_mib']:7.0f}  {u['kv_committed_mib']:14.0f}  "
                  f"{u['fds']:3d}  {u['threads']:7d}  {u['processes']:9d}")
    a = result["usage_after"]
    print(f"after the load: RSS {a['rss_mib']:.0f} MiB, {a['fds']} fds, {a['threads']} threads")
    print("RSS by process (MiB), first sample -> last under load: " + ", ".join(
        f"{name}: {usage[0]['rss_mib_by_process'].get(name, 0)} -> {mib}"
        for name, mib in usage[-1]["rss_mib_by_process"].items()))
    print(f"KV usage after the load: {result['kv_cache_usage_after']}, "
          f"running: {result['running_after']}")
    problems = verdict(result)
    print("PASS" if not problems else "FAIL: " + "; ".join(problems))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if not args.no_result:
        record(result, problems, args.server_args, args.variant)
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
