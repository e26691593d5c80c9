"""Every triton kernel variant a CUDA step can launch compiles for sm_80 and sm_90 with
no GPU, fits the target's shared memory, and lowers every dot to tensor-core
instructions: the attention backend's (bf16/fp16, head_dim 64, 128 and 256; GQA group,
block size and split count are runtime arguments, split-K on and off are two
variants), the layer ops' (triton_layer_ops), a decode batch's linears with their norms
(triton_decode_linear), the GGUF-block GEMM's (triton_gguf_gemm) and the fp8 decode GEMM's (sm_90 only:
e4m3 needs sm_89+).

Written against triton 3.9.0 (the version the test extra pins). It runs in its own
process: the interpreter tests in this process import the kernels interpreted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "tokenmill.attention.triton.compile_check",
                           "--json"], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_every_variant_compiles_within_shared_memory_on_tensor_cores(compiled):
    results = compiled["results"]
    per_head = {"store_kv", "decode", "decode_split", "decode_reduce", "prefill", "rotary",
                "rotary_store"}
    layer_ops = {"rms_norm", "rms_norm_add", "silu_mul"}
    fp8 = {"fp8_rows", "fp8_gemm_reduce", "fp8_linear", "fp8_linear_split",
           *(f"fp8_gemm_m{m}{split}" for m in (16, 32, 64) for split in ("", "_split"))}
    gguf = {f"gguf_{t}_{v}" for t in ("q8_0", "q4_0", "q4_k", "q6_k")
            for v in ("m16", "m64", "dequant")}
    moe = {"fused_moe_gate_up", "fused_moe_down"}  # and their e4m3 variants, sm_89+
    decode_linear = {f"decode_linear_{p}_n{n}" for p in ("plain", "norm", "add_norm", "silu_mul")
                     for n in (16, 32, 64)}
    dtypes, targets = ("bf16", "fp16"), ("sm_80", "sm_90")
    got = {(r["kernel"], r["dtype"], r["head_dim"], r["target"]) for r in results}
    assert got == ({(k, dt, d, t) for k in per_head for dt in dtypes for d in (64, 128, 256)
                    for t in targets}
                   | {(k, dt, 0, t) for k in layer_ops | gguf | decode_linear for dt in dtypes
                      for t in targets}
                   | {(k, dt, 0, t) for k in moe for dt in dtypes for t in targets}
                   | {(k, dt, 0, "sm_90") for k in fp8 | {f"{m}_fp8" for m in moe}
                      for dt in dtypes})  # e4m3: sm_89+
    dequant = {k for k in gguf if k.endswith("_dequant")}  # no dot: a store of the weight
    for r in results:
        assert r["shared"] <= r["shared_limit"], r
        assert r["tensor_core_dots"] == r["dots"], r
        if r["kernel"] in ("decode", "decode_split", "prefill") or \
                r["kernel"].startswith(("fp8_gemm_m", "fp8_linear", "fused_moe", "gguf_",
                                        "decode_linear")) and r["kernel"] not in dequant:
            assert r["dots"] > 0
            assert r["ptx_mma"] > 0 or (r["target"] == "sm_90" and r["ptx_wgmma"] > 0), r
        assert r["ok"], r
    # sm_90's prefill tiles (64 queries, 4 warps) map to Hopper's wgmma
    assert all(r["ptx_wgmma"] > 0 for r in results
               if r["kernel"] == "prefill" and r["target"] == "sm_90")
