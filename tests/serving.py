"""Start a real `tokenmill serve` process on a free loopback port, for tests: the
benchmarks' starter (benchmarks/server.py; benchmarks import nothing from tests/),
and the process helpers the tests add."""

from __future__ import annotations

import os
import time

from benchmarks.server import ServerProcess, free_port, start_server

__all__ = ["ServerProcess", "child_pids", "free_port", "pid_alive", "start_server",
           "wait_until"]


def child_pids(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (Linux /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry))
    return children


def pid_alive(pid: int) -> bool:
    """Running or stopped; a zombie or a reaped pid is not alive."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
