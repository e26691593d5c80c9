"""llama-perplexity on one file: its log-prob file (--kl-divergence-base) and its
own KLD report (--kl-divergence), parsed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from benchmarks.accuracy_gate import llama_files


def _run(cmd: list[str]) -> str:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"llama-perplexity failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    return proc.stdout


def write_logprobs(binary: Path, model: Path, text: Path, out: Path, n_ctx: int = 512,
                   threads: int = 2, chunks: int | None = None) -> llama_files.LlamaLogprobs:
    """llama-perplexity -m MODEL -f TEXT -c N_CTX [--chunks N] --kl-divergence-base OUT
    (kept when it exists and reads back whole: the caller's file names carry the text's
    hash and the chunk count)."""
    if out.is_file():
        try:
            return llama_files.read(out)
        except ValueError:
            out.unlink()
    tmp = out.with_name(out.name + ".part")
    limit = ["--chunks", str(chunks)] if chunks else []
    _run([str(binary), "-m", str(model), "-f", str(text), "-c", str(n_ctx), "-t", str(threads),
          *limit, "--kl-divergence-base", str(tmp)])
    tmp.replace(out)
    return llama_files.read(out)


_FIGURES = {
    "ppl": r"Mean PPL\(Q\)\s*:\s*([-\d.]+)\s*±\s*([-\d.]+)",
    "ppl_base": r"Mean PPL\(base\)\s*:\s*([-\d.]+)\s*±\s*([-\d.]+)",
    "ppl_ratio": r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([-\d.]+)\s*±\s*([-\d.]+)",
    "kld_mean": r"Mean\s+KLD:\s*([-\d.]+)\s*±\s*([-\d.]+)",
    "kld_p99": r"99\.0%\s+KLD:\s*([-\d.]+)",
    "same_top_pct": r"Same top p:\s*([-\d.]+)\s*±\s*([-\d.]+)\s*%",
}


def parse_kld_report(out: str) -> dict[str, float]:
    """The figures `kl_divergence()` prints at its end: value and, where printed, its
    ± (llama.cpp's own standard error)."""
    got: dict[str, float] = {}
    for key, pattern in _FIGURES.items():
        m = re.search(pattern, out)
        if m is None:
            raise ValueError(f"llama-perplexity printed no {key!r} line ({pattern})")
        got[key] = float(m.group(1))
        if m.lastindex and m.lastindex > 1:
            got[key + "_pm"] = float(m.group(2))
    return got


def kld_report(binary: Path, model: Path, text: Path, base: Path, n_ctx: int = 512,
               threads: int = 2) -> dict[str, float]:
    """llama-perplexity -m MODEL -f TEXT --kl-divergence-base BASE --kl-divergence."""
    out = _run([str(binary), "-m", str(model), "-f", str(text), "-c", str(n_ctx),
                "-t", str(threads), "--kl-divergence-base", str(base), "--kl-divergence"])
    return parse_kld_report(out)
