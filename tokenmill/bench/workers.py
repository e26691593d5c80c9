"""`--workers N`: the load generator as N processes, so that one Python event loop does
not cap the rate at which streamed tokens can be read and timestamped.

Every worker computes the same global schedule (the same seeded arrival process) and
sends the jobs whose index is its own modulo N, with its share of `--concurrency`. All
of them timestamp on `time.perf_counter()` (CLOCK_MONOTONIC, one clock for every
process on the host) from one start time the parent chooses once all are ready, so
their records merge without translation. Each finished record travels back through a
queue as it completes (the parent's progress bar moves with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import queue as queue_mod
import time
import traceback
from dataclasses import replace

import numpy as np

from tokenmill.bench.client import ClientOptions, OpenAIClient
from tokenmill.bench.runner import Dispatched, LoadSpec, OnDone, Shard, dispatch
from tokenmill.bench.workload import BenchRequest

START_MARGIN_S = 0.05  # from the parent's "go" to the shared clock's zero
READY_TIMEOUT_S = 120.0


def split_concurrency(concurrency: int | None, workers: int) -> list[int | None]:
    """Worker w's share of the in-flight limit (they add up to it); never 0."""
    if not concurrency:
        return [None] * workers
    return [concurrency // workers + (w < concurrency % workers) for w in range(workers)]


def run_sharded(options: ClientOptions, requests: list[BenchRequest], load: LoadSpec,
                rng: np.random.Generator, on_done: OnDone, max_requests: int | None,
                workers: int, dropped_fields: list[str]) -> Dispatched:
    """Run the load from `workers` processes (fewer when --concurrency is smaller) and
    merge their records, sorted as one generator would have produced them."""
    workers = max(1, min(workers, load.concurrency or workers))
    ctx = mp.get_context("spawn")  # no fork: the parent may hold threads and sockets
    results = ctx.Queue()
    go = ctx.Event()
    start = ctx.Value("d", 0.0)
    procs = []
    for w, conc in enumerate(split_concurrency(load.concurrency, workers)):
        p = ctx.Process(target=_worker, daemon=True, name=f"bench-worker-{w}",
                        args=(w, workers, options, requests, replace(load, concurrency=conc),
                              rng, max_requests, list(dropped_fields), results, go, start))
        p.start()
        procs.append(p)
    try:
        ready, deadline = 0, time.monotonic() + READY_TIMEOUT_S
        while ready < workers:
            msg = _get(results, procs, deadline - time.monotonic())
            if msg[0] == "error":
                raise RuntimeError(f"bench worker {msg[1]} failed:\n{msg[2]}")
            ready += msg[0] == "ready"
        cpu0 = time.process_time()
        start.value = time.perf_counter() + START_MARGIN_S
        go.set()
        records, usages, ended = [], [], 0
        while ended < workers:
            msg = _get(results, procs, None)
            if msg[0] == "done":
                records.append(msg[1])
                on_done(msg[1])
            elif msg[0] == "end":
                ended += 1
                usages.append(msg[2])
                dropped_fields.extend(f for f in msg[3] if f not in dropped_fields)
            elif msg[0] == "error":
                raise RuntimeError(f"bench worker {msg[1]} failed:\n{msg[2]}")
        parent_cpu = time.process_time() - cpu0
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    records.sort(key=lambda r: (r.request_id, r.turn_index))
    return Dispatched(records, max((r.end_time_s for r in records), default=0.0), usages,
                      parent_cpu)


def _get(results, procs: list, timeout_s: float | None) -> tuple:
    """The next message; raises if a worker died without saying why."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            return results.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"bench worker {dead[0].name} exited with "
                                   f"{dead[0].exitcode}") from None
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError("bench workers did not start in time") from None


def _worker(index: int, count: int, options: ClientOptions, requests: list[BenchRequest],
            load: LoadSpec, rng: np.random.Generator, max_requests: int | None,
            dropped_fields: list[str], results, go, start) -> None:
    try:
        asyncio.run(_worker_run(index, count, options, requests, load, rng, max_requests,
                                dropped_fields, results, go, start))
    except Exception:  # noqa: BLE001 — the parent reports it
        results.put(("error", index, traceback.format_exc()))


async def _worker_run(index, count, options, requests, load, rng, max_requests,
                      dropped_fields, results, go, start) -> None:
    client = OpenAIClient(options)
    client.dropped_fields = dropped_fields
    try:
        with contextlib.suppress(Exception):  # a warm connection before the clock starts
            await client.warm()
        results.put(("ready", index))
        await asyncio.to_thread(go.wait)
        done = await dispatch(client.send, requests, load, rng,
                              lambda r: results.put(("done", r)), max_requests,
                              Shard(index, count, start.value))
        results.put(("end", index, done.usages[0], client.dropped_fields))
    finally:
        await client.aclose()
