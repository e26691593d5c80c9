"""The peers the W1-W5 benchmarks run beside tokenmill, in the same run.

vLLM's CPU backend (its own venv and a bf16 HF checkpoint, made by
setup_vllm_cpu.sh) and llama.cpp's llama-server / llama-bench (built by
build_llama_cpp.sh), both cached under ${TOKENMILL_PEERS_DIR:-~/.cache/tokenmill-peers};
transformers needs nothing beyond tokenmill's own environment. `ensure_vllm()`
and `ensure_llama_cpp()` run the setup scripts (idempotent: seconds once done)
and return the paths, or None and the reason, so that a benchmark skips a peer
it cannot set up with a clear message instead of failing.

    from benchmarks.peers import ensure_vllm, start_vllm_server
    vllm, why = ensure_vllm()
    if vllm is None: print(f"vLLM skipped: {why}")
    with start_vllm_server(vllm, threads="both") as server: ...
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .offline import run_llama_bench, run_vllm_offline
from .servers import PeerServer, start_llama_server, start_vllm_server

__all__ = ["LlamaCpp", "PeerServer", "Vllm", "add_peer_args", "ensure_llama_cpp",
           "ensure_vllm", "peers_dir", "run_llama_bench", "run_vllm_offline",
           "selected_peers", "start_llama_server", "start_vllm_server"]

HERE = Path(__file__).resolve().parent
ALL_PEERS = ("vllm", "llama", "transformers")


@dataclass(frozen=True)
class Vllm:
    python: Path      # the interpreter of vLLM's own venv
    model_dir: Path   # the bf16 HF checkpoint of the embedded model


@dataclass(frozen=True)
class LlamaCpp:
    server: Path      # llama-server
    bench: Path       # llama-bench


def peers_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_PEERS_DIR",
                               Path.home() / ".cache" / "tokenmill-peers"))


def _run_setup(script: str, env: dict[str, str] | None = None
               ) -> tuple[dict[str, str] | None, str | None]:
    """Run a setup script, echoing its progress (stderr); its KEY=PATH stdout lines."""
    cmd = ["bash", str(HERE / script)]
    print(f"[peers] {script} (idempotent; the first run installs/builds)", flush=True)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, **(env or {})})
    except OSError as e:
        return None, f"cannot run {script}: {e}"
    tail: list[str] = []
    assert proc.stderr is not None and proc.stdout is not None
    for line in proc.stderr:
        tail = (tail + [line.rstrip()])[-15:]
        print(f"[peers]   {line.rstrip()}", file=sys.stderr, flush=True)
    out = proc.stdout.read()
    if proc.wait() != 0:
        last = next((x for x in reversed(tail) if x.startswith(script)), tail[-1] if tail
                    else "no message")
        return None, f"{script} exited with {proc.returncode}: {last}"
    paths = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return paths, None


@functools.cache
def ensure_vllm() -> tuple[Vllm | None, str | None]:
    """vLLM's venv and checkpoint (setup_vllm_cpu.sh), or None and the reason."""
    paths, why = _run_setup("setup_vllm_cpu.sh", {"TOKENMILL_PYTHON": sys.executable})
    if paths is None:
        return None, why
    try:
        return Vllm(Path(paths["VLLM_PYTHON"]), Path(paths["VLLM_MODEL_DIR"])), None
    except KeyError as e:
        return None, f"setup_vllm_cpu.sh printed no {e.args[0]}= line"


@functools.cache
def ensure_llama_cpp() -> tuple[LlamaCpp | None, str | None]:
    """llama-server and llama-bench (build_llama_cpp.sh), or None and the reason."""
    paths, why = _run_setup("build_llama_cpp.sh")
    if paths is None:
        return None, why
    try:
        return LlamaCpp(Path(paths["LLAMA_SERVER"]), Path(paths["LLAMA_BENCH"])), None
    except KeyError as e:
        return None, f"build_llama_cpp.sh printed no {e.args[0]}= line"


def add_peer_args(ap: argparse.ArgumentParser, default: tuple[str, ...]) -> None:
    """`--peers a,b` (default: this workload's peers) and `--skip-peers`."""
    ap.add_argument("--peers", default=",".join(default),
                    help=f"comma-separated peers to run beside tokenmill, from "
                    f"{','.join(default)} (default: all of them)")
    ap.add_argument("--skip-peers", action="store_true", help="run tokenmill only")


def selected_peers(args: argparse.Namespace, default: tuple[str, ...]) -> set[str]:
    if args.skip_peers:
        return set()
    chosen = {p.strip() for p in args.peers.split(",") if p.strip()}
    unknown = chosen - set(default)
    if unknown:
        raise SystemExit(f"--peers: {', '.join(sorted(unknown))} is not a peer of this "
                         f"benchmark (choose from {', '.join(default)})")
    return chosen


def skip(peer: str, why: str | None) -> None:
    print(f"[peers] {peer} SKIPPED: {why}", flush=True)


def ensure_servers(peers: set[str]) -> tuple[Vllm | None, LlamaCpp | None]:
    """vLLM and llama.cpp set up for the selected peers; each that cannot be (or was
    not selected) is None, with the reason printed."""
    vllm = llama = None
    if "vllm" in peers:
        vllm, why = ensure_vllm()
        if vllm is None:
            skip("vLLM", why)
    if "llama" in peers:
        llama, why = ensure_llama_cpp()
        if llama is None:
            skip("llama.cpp", why)
    return vllm, llama
