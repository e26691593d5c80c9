"""Peer servers on a free loopback port: vLLM's OpenAI server and llama-server.

Each runs in its own session (process group) so that `stop()` ends it and
every process it spawned (vLLM's engine core); use them as context managers.
Logs go to a file whose tail is shown when a server fails to start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx

VLLM_KVCACHE_SPACE_GIB = "4"
VLLM_MAX_MODEL_LEN = "4096"
# PERFORMANCE.md: 90-110 s on a quiet machine (it compiles); much more under load
VLLM_READY_TIMEOUT_S = 900.0
LLAMA_READY_TIMEOUT_S = 120.0


@dataclass
class PeerServer:
    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    startup_s: float = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(name: str, cmd: list[str], env: dict[str, str], ready_timeout_s: float
           ) -> PeerServer:
    port = _free_port()
    cmd = [*cmd, "--host", "127.0.0.1", "--port", str(port)]
    log_path = Path(tempfile.gettempdir()) / f"tokenmill-peer-{name.split()[0]}-{port}.log"
    print(f"[peers] starting {name}: {' '.join(cmd)} (log {log_path})", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    server = PeerServer(name, proc, port, log_path)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready; "
                               f"log {log_path}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                server.startup_s = time.perf_counter() - t0
                print(f"[peers] {name} ready in {server.startup_s:.0f} s", flush=True)
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"{name} not ready in {ready_timeout_s:.0f} s; log {log_path}:\n"
                       f"{server.log_tail()}")


def vllm_env(threads: str) -> dict[str, str]:
    """vLLM's CPU settings: `both` gives it both cores (its best figure here);
    `default` leaves its own choice (one core reserved for the front end)."""
    if threads not in ("both", "default"):
        raise ValueError(f"threads must be 'both' or 'default', not {threads!r}")
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                        "PYTHONPATH", "VIRTUAL_ENV")}
    env["VLLM_CPU_KVCACHE_SPACE"] = VLLM_KVCACHE_SPACE_GIB
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    if threads == "both":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 2) - 1}"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def start_vllm_server(vllm, threads: str = "both", prefix_caching: bool | None = None,
                      ready_timeout_s: float = VLLM_READY_TIMEOUT_S) -> PeerServer:
    """`python -m vllm.entrypoints.openai.api_server` (its `vllm` console script
    fails on this image), serving the bf16 checkpoint as "smollm2-135m".
    prefix_caching None keeps vLLM's default (on in vLLM 0.32)."""
    cmd = [str(vllm.python), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(vllm.model_dir), "--served-model-name", "smollm2-135m",
           "--dtype", "bfloat16", "--max-model-len", VLLM_MAX_MODEL_LEN]
    if prefix_caching is not None:
        cmd.append("--enable-prefix-caching" if prefix_caching
                   else "--no-enable-prefix-caching")
    name = "vLLM (both cores)" if threads == "both" else "vLLM (default)"
    return _start(name, cmd, vllm_env(threads), ready_timeout_s)


def start_llama_server(llama, gguf: Path, np: int = 16, ctx: int = 16384, threads: int = 2,
                       ready_timeout_s: float = LLAMA_READY_TIMEOUT_S) -> PeerServer:
    """`llama-server -t 2 -np NP -c CTX --no-webui` on a GGUF file; each of the NP
    slots gets CTX/NP tokens of context. Its prompt cache is on by default. The served
    name is the embedded model's alias for the embedded file, else the file's stem."""
    embedded = gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    cmd = [str(llama.server), "-m", str(gguf), "-t", str(threads), "-np", str(np),
           "-c", str(ctx), "--no-webui", "-a", "smollm2-135m" if embedded else gguf.stem]
    return _start(f"llama-server (-np {np} -c {ctx})", cmd, dict(os.environ), ready_timeout_s)
