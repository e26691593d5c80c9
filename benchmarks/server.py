"""A real `tokenmill serve` process on a free loopback port, for the served benchmarks
(W2, W5, structured output, data parallel), and for the tests (tests/serving.py
imports it: benchmarks import nothing from tests/)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(*args: str, ready_timeout_s: float = 180.0, env: dict | None = None,
                 log_dir: str = "/tmp") -> ServerProcess:
    port = free_port()
    log_path = os.path.join(log_dir, f"tokenmill-serve-{port}.log")
    log = open(log_path, "w")  # noqa: SIM115 - the server process writes to it until stop()
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", *args,
           "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    server = ServerProcess(proc, port, log_path)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"server not ready in {ready_timeout_s} s:\n{server.log()[-4000:]}")




def router_binary() -> str | None:
    """vllm-router's executable: this interpreter's venv first, then PATH."""
    here = str(Path(sys.executable).parent)
    return shutil.which("vllm-router", path=here) or shutil.which("vllm-router")


@contextlib.contextmanager
def running_router(args: list[str], prefix: tuple[str, ...] = (),
                   log_path: str | None = None) -> Iterator[str]:
    """vllm-router on a free loopback port with `args` (its routing flags; `prefix` goes
    before the binary, e.g. taskset); yields its URL once /health answers, stops it after."""
    binary = router_binary()
    if binary is None:
        raise RuntimeError("vllm-router is not installed (pip install vllm-router)")
    port = free_port()
    cmd = [*prefix, binary, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *args]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {proc.returncode}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        if log is not subprocess.DEVNULL:
            log.close()
