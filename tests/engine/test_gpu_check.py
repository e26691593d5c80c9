"""benchmarks/gpu_check.py --smoke: the GPU check's code paths on a CPU (tiny
shapes, the triton interpreter, the decode graphs' closure run eagerly), every
row of its table filled. In its own process: it sets TRITON_INTERPRET before
triton is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smoke_fills_every_row(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "benchmarks" / "gpu_check.py")
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, script, "--smoke", "--json", "--out", str(out)],
                          check=False,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["device"].startswith("cpu")
    rows = result["rows"]
    assert not [r for r in rows if r["value"] in ("", None, "FAILED")], rows
    checks = [r["check"] for r in rows]
    for expected in ("HBM bandwidth", "bf16 matmul peak", "logits vs transformers",
                     "engine greedy tokens vs transformers", "triton vs torch attention",
                     "batch 1 TPOT, eager", "batch 1 decode", "batch 8 decode", "batch 32 decode",
                     "batch 64 decode", "graphs vs eager", "prefill 32 tokens", "prefill 128",
                     "fp8 batch 1 decode", "fp8 vs float32 at batch 1", "fp8 batch 64 decode",
                     "async scheduling greedy tokens", "async scheduling batch 1 decode",
                     "async vs sync scheduling at batch 64", "batch 1 decode, rotary then store",
                     "rotary+store in one kernel vs two at batch 64",
                     "batch 1 decode, norm then cuBLAS", "decode linears fused vs cuBLAS at batch 8",
                     "fp8 batch 1 decode, three kernels", "fp8 one launch vs three at batch 1",
                     "fused MoE kernel vs grouped experts", "MoE batch 1 decode",
                     "MoE batch 64 decode", "engine ready, dummy weights", "  engine built",
                     *(f"gguf {t} " for t in ("Q4_K", "Q6_K", "Q8_0", "Q4_0"))):
        assert any(c.startswith(expected) for c in checks), expected
    by_check = {r["check"]: r for r in rows}
    assert float(by_check["logits vs transformers (fp32, 24 tokens)"]["value"]) < 1e-3
    assert by_check["engine greedy tokens vs transformers"]["value"] == "48/48"
    assert by_check["async scheduling greedy tokens vs transformers"]["value"] == "36/36"
    assert float(by_check["triton vs torch attention (mixed batch)"]["value"]) < 1e-4
    gguf = [r for r in rows if r["section"] == "gguf"]
    assert len(gguf) == 16  # 4 cases: error, bandwidth, ratio to bf16, prompt without copy
    assert all(float(r["value"]) < 2e-2 for r in gguf if "dequantization" in r["check"])
    assert json.loads(out.read_text())["rows"] == rows  # written as it went
    assert float(by_check["fused MoE kernel vs grouped experts"]["value"]) < 1e-5
    table = proc.stdout.strip().splitlines()[:-1]
    sections = ("machine", "correctness", "gguf", "speed", "start-up")
    assert len([line for line in table if line.startswith(sections)]) \
        == len(rows)
