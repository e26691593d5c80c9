"""docs/roofline.md's Llama-3-8B-on-H100 worked example as golden numbers, each term derived by hand
from the architecture (32 layers, hidden 4096, 32 heads / 8 KV heads of 128, MLP 14336,
vocab 128256, untied embeddings) so a wrong formula cannot agree with itself."""

import json

import pytest

from tokenmill.cli import main

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 32, 4096, 32, 8, 128, 14336, 128256
EMBED = VOCAB * HIDDEN
LAYER_LINEAR = (HIDDEN * HEADS * HEAD_DIM * 2          # q, o
                + HIDDEN * KV_HEADS * HEAD_DIM * 2     # k, v
                + 3 * HIDDEN * MLP)                    # gate, up, down
NORMS = (2 * LAYERS + 1) * HIDDEN
PARAMS = 2 * EMBED + LAYERS * LAYER_LINEAR + NORMS
KV_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
BANDWIDTH, PEAK = 3.35e12, 989.5e12
CONTEXT, PROMPT, OUTPUT = 1280, 1024, 256


def roofline(capsys, *argv) -> dict:
    assert main(["roofline", "llama-3-8b", "--hardware", "h100", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def step_bytes(batch: int) -> int:
    # every weight but the input embedding, of which only `batch` rows are gathered
    weights = (PARAMS - EMBED + batch * HIDDEN) * 2
    kv = batch * (CONTEXT + 1) * KV_PER_TOKEN  # read the context, append one token
    return weights + kv


def test_parameters_weights_and_kv(capsys):
    r = roofline(capsys, "--batch", "1")
    assert r["total_params"] == PARAMS == 8_030_261_248
    assert r["weight_bytes"] == 2 * PARAMS  # 16.06 GB
    assert r["kv_bytes_per_token"] == KV_PER_TOKEN == 131_072
    assert r["kv_bytes_per_sequence"] == CONTEXT * KV_PER_TOKEN  # 167.8 MB


def test_decode_rows(capsys):
    r = roofline(capsys, "--batch", "1,8,64,256", "--cost-per-hour", "2")
    rows = {row["batch"]: row for row in r["decode"]}
    for batch, row in rows.items():
        assert row["bytes_per_step"] == step_bytes(batch)
        attention = 2 * HEADS * 2 * HEAD_DIM * LAYERS * CONTEXT  # QKᵀ and PV per token
        assert row["flops_per_step"] == batch * (2 * (LAYERS * LAYER_LINEAR + EMBED) + attention)
        assert row["bound"] == "memory"
        assert row["step_floor_ms"] == pytest.approx(step_bytes(batch) / BANDWIDTH * 1e3)
    # docs/roofline.md's table
    assert rows[1]["bytes_per_step"] / 1e9 == pytest.approx(15.18, abs=0.005)
    assert rows[1]["flops_per_step"] / 1e9 == pytest.approx(15.7, abs=0.05)
    assert rows[1]["step_floor_ms"] == pytest.approx(4.53, abs=0.005)
    assert rows[1]["tok_s_total"] == pytest.approx(221, abs=0.5)
    assert rows[1]["cost_per_1m_output_tokens"] == pytest.approx(2.52, abs=0.005)
    assert rows[8]["bytes_per_step"] / 1e9 == pytest.approx(16.35, abs=0.005)
    assert rows[8]["tok_s_total"] == pytest.approx(1639, abs=0.5)
    assert rows[64]["bytes_per_step"] / 1e9 == pytest.approx(25.76, abs=0.005)
    assert rows[64]["arithmetic_intensity"] == pytest.approx(39.0, abs=0.05)
    assert rows[64]["step_floor_ms"] == pytest.approx(7.69, abs=0.005)
    assert rows[64]["tok_s_total"] == pytest.approx(8324, abs=0.5)
    assert rows[64]["cost_per_1m_output_tokens"] == pytest.approx(0.0667, abs=0.00005)
    assert rows[256]["bytes_per_step"] / 1e9 == pytest.approx(58.00, abs=0.005)
    assert rows[256]["tok_s_total"] == pytest.approx(14787, abs=0.5)


def test_prefill_includes_causal_attention(capsys):
    p = roofline(capsys, "--batch", "1")["prefill"]
    matmul = 2 * PROMPT * LAYERS * LAYER_LINEAR + 2 * EMBED  # LM head for the last token only
    # token i attends to i + 1 tokens: QKᵀ and PV, 2 FLOPs per multiply-add, every head, layer
    attention = 2 * HEADS * 2 * HEAD_DIM * LAYERS * (PROMPT * (PROMPT + 1) // 2)
    assert attention == 275_146_342_400
    assert p["flops"] == matmul + attention
    assert p["flops"] / 1e12 == pytest.approx(14.6, abs=0.05)
    assert p["bytes"] / 1e9 == pytest.approx(15.15, abs=0.005)
    assert p["arithmetic_intensity"] == pytest.approx(962, abs=0.5)
    assert p["bound"] == "compute"
    assert p["ttft_floor_ms"] == pytest.approx((matmul + attention) / PEAK * 1e3)
    assert p["ttft_floor_ms"] == pytest.approx(14.7, abs=0.05)


def test_max_batch_end_to_end_and_fleet_lines(capsys):
    r = roofline(capsys, "--batch", "1")
    assert r["max_batch"] == int((0.9 * 80e9 - 2 * PARAMS) // (CONTEXT * KV_PER_TOKEN)) == 333
    assert main(["roofline", "llama-3-8b", "--hardware", "h100", "--batch", "1,8,64,256",
                 "--cost-per-hour", "2", "--fleet-gpus", "1800", "--hours", "24"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("Prefill of 1,024 tokens: 14.6 TFLOP, 15.15 GB moved, 962 FLOP/byte → "
            "compute-bound, TTFT floor 14.7 ms") in out
    assert "Largest batch that fits at 1,280 tokens of context: 333 sequences" in out
    assert ("One request alone at batch 1: TTFT 14.7 ms + 255 × TPOT 4.53 ms = 1,170 ms end "
            "to end") in out
    assert "Fleet: 1,800 devices × 24 h × $2.00/h = $86,400" in out
    e2e_ms = (r["prefill"]["ttft_floor_ms"]
              + (OUTPUT - 1) * r["decode"][0]["tpot_floor_ms"])
    assert e2e_ms == pytest.approx(1170, abs=0.5)
