"""Rank 0 joins the group while watching the workers it started: a worker that
dies before it joins (a bad flag, an import error, out of memory) fails start-up
at once with its exit code and the last lines it wrote, instead of rank 0
waiting out the store's timeout (10 minutes) for a rank that will never come.

The join itself (torch's TCP store wait) cannot be interrupted, so it runs on a
daemon thread and this thread polls the workers; on a death the join thread is
abandoned and the caller kills the rest and fails.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from tokenmill.distributed.errors import TensorParallelError

T = TypeVar("T")
_TAIL_LINES = 20
_POLL_S = 0.1


class TeedWorker:
    """A worker process whose stderr is copied to ours line by line, its last lines kept."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        threading.Thread(target=self._copy, daemon=True, name="tp-worker-stderr").start()

    def _copy(self) -> None:
        assert self.proc.stderr is not None
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace")
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
            sys.stderr.flush()

    def __getattr__(self, name: str) -> Any:  # poll, wait, kill, pid: the Popen's
        return getattr(self.proc, name)


def join_watching(join: Callable[[], T], workers: dict[int, TeedWorker]) -> T:
    """join()'s result, or TensorParallelError naming the first worker that exited."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = join()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e
        done.set()

    threading.Thread(target=run, daemon=True, name="tp-join").start()
    while not done.wait(_POLL_S):
        for rank, worker in workers.items():
            code = worker.poll()
            if code is not None:
                worker.proc.wait()
                last = "\n".join(worker.tail) or "(it wrote nothing to stderr)"
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} (pid {worker.pid}) exited with code {code} "
                    f"before it joined the group; its last output:\n{last}")
    if "error" in box:
        raise box["error"]
    return box["value"]
