"""The small KLD table benchmarks/accuracy.py prints above its last line: the path
under test (and today's default) against the fp32 reference on the first few chunks,
with llama.cpp's figures beside them when llama.cpp is already built (accuracy.py
must stay within 10 minutes on 2 cores, so it never builds it). The full gate is
benchmarks/kld_gate.py."""

from __future__ import annotations

from benchmarks.accuracy_gate.gate import GateConfig, render, run


def kld_table(model: str, path_flags: str, chunks: int) -> str:
    from benchmarks.peers.model_files import llama_built

    paths = {"default": ""}
    if path_flags.strip():
        paths[path_flags] = path_flags
    cfg = GateConfig(model=model, paths=paths, max_chunks=chunks, use_llama=llama_built(),
                     resamples=300)
    return render(run(cfg))
