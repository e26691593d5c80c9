"""A real `tokenmill serve` process on a free loopback port, for the served benchmarks
(W2, W5, structured output, data parallel), and for the tests (tests/serving.py
imports it: benchmarks import nothing from tests/)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

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


