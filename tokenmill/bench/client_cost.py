"""What the load generator itself cost: CPU seconds and event-loop lag during a run.

A client on the same host as the server competes with it for cores (a 2-core server ran
12% slower under a busy third-party client), so the bench measures itself and warns
when it shares the machine with its target and took more than 10% of it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlparse

import numpy as np

CPU_SHARE_WARN = 0.10
LAG_PROBE_S = 0.005  # the lag probe's sleep: its overshoot is the loop's lag


@dataclass
class ClientCost:
    """`cpu_seconds`: user + system CPU of the generator processes (every thread) during
    the run; `cpu_share` = cpu_seconds / (wall_s × num_cpus), 0..1 of the machine;
    `loop_lag_ms`: how late a 5 ms sleep in each event loop woke up (mean, p50, p99, max)."""

    cpu_seconds: float
    wall_s: float
    num_cpus: int
    cpu_share: float
    loop_thread_cpu_seconds: float  # the event-loop thread(s) alone
    num_threads: int
    workers: int
    loop_lag_ms: dict[str, float | int | None]
    same_host: bool | None  # the target is on this machine (loopback); None offline
    warning: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ProcessUsage:
    """One generator process's share, mergeable across worker processes."""

    cpu_seconds: float
    loop_thread_cpu_seconds: float
    num_threads: int
    lag_samples_s: list[float]


class CostMeter:
    """`start()` before the run, `await probe()` as a task in the loop, `stop()` after."""

    def __init__(self) -> None:
        self.lag_samples_s: list[float] = []
        self._cpu0 = self._thread0 = 0.0
        self._running = False
        self.usage: ProcessUsage | None = None

    def start(self) -> None:
        self._cpu0, self._thread0 = time.process_time(), time.thread_time()
        self._running = True

    async def probe(self) -> None:
        while self._running:
            t = time.perf_counter()
            await asyncio.sleep(LAG_PROBE_S)
            self.lag_samples_s.append(max(0.0, time.perf_counter() - t - LAG_PROBE_S))

    def stop(self) -> ProcessUsage:
        self._running = False
        self.usage = ProcessUsage(time.process_time() - self._cpu0,
                                  time.thread_time() - self._thread0,
                                  threading.active_count(), self.lag_samples_s)
        return self.usage


def summarize_cost(usages: list[ProcessUsage], wall_s: float, base_url: str | None,
                   extra_cpu_s: float = 0.0) -> ClientCost:
    """One ClientCost from every process's usage (+ the parent's own CPU, `extra_cpu_s`)."""
    num_cpus = os.cpu_count() or 1
    cpu = sum(u.cpu_seconds for u in usages) + extra_cpu_s
    lags = np.asarray([s for u in usages for s in u.lag_samples_s], dtype=float) * 1e3
    lag = {"mean": float(lags.mean()) if lags.size else None,
           "p50": float(np.percentile(lags, 50)) if lags.size else None,
           "p99": float(np.percentile(lags, 99)) if lags.size else None,
           "max": float(lags.max()) if lags.size else None, "count": int(lags.size)}
    share = cpu / (max(wall_s, 1e-9) * num_cpus)
    same = is_same_host(base_url) if base_url else None
    return ClientCost(cpu_seconds=cpu, wall_s=wall_s, num_cpus=num_cpus, cpu_share=share,
                      loop_thread_cpu_seconds=sum(u.loop_thread_cpu_seconds for u in usages),
                      num_threads=sum(u.num_threads for u in usages), workers=len(usages),
                      loop_lag_ms=lag, same_host=same,
                      warning=bool(same) and share > CPU_SHARE_WARN)


def is_same_host(base_url: str) -> bool:
    """The URL's host is this machine: a loopback address, this host's name, or an
    address this host's name resolves to."""
    host = urlparse(base_url).hostname or ""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    try:
        mine = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        mine = set()
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in mine for a in addrs)


def cost_note(cost: ClientCost) -> str | None:
    if not cost.warning:
        return None
    return (f"the load generator used {100 * cost.cpu_share:.0f}% of this machine's "
            f"{cost.num_cpus} CPUs ({cost.cpu_seconds:.2f} CPU s in {cost.wall_s:.1f} s) on the "
            f"same host as the server (> {100 * CPU_SHARE_WARN:.0f}%): it competes with the "
            f"server for cores and slows it; run the client on another machine, or use fewer "
            f"--workers")
