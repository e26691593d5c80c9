"""Floors and cost arithmetic against hand-computed values."""

import pytest

from tokenmill.roofline.arch import ModelArch, WeightBits
from tokenmill.roofline.cost_model import (
    analyze,
    cost_per_million_tokens,
    fleet_cost,
)
from tokenmill.roofline.hardware import CATALOG
from tokenmill.roofline.presets import preset_config

LLAMA = ModelArch.from_config(preset_config("llama-3-8b"))
BF16 = WeightBits.from_name("bf16")
H100 = CATALOG["h100-sxm"]


def report(**kw):
    args = {"batches": [1, 64], "prompt_len": 1024, "output_len": 256, "context": 1280,
                "kv_dtype": "bf16"}
    return analyze(LLAMA, BF16, H100, **{**args, **kw})


def test_cost_arithmetic():
    assert cost_per_million_tokens(3.0, 1000.0) == pytest.approx(0.8333, abs=1e-4)
    assert fleet_cost(1800, 24, 2.0) == 86_400


def test_llama3_8b_decode_floor_on_h100():
    r = report(context=1)
    batch1 = r.rows[0]
    assert H100.memory_bandwidth_bytes_s == 3.35e12
    # all 16.06 GB ÷ 3.35 TB/s = 4.79 ms: the usual back-of-envelope floor
    assert r.weight_bytes / 3.35e12 * 1e3 == pytest.approx(4.79, abs=0.01)
    # a decode step gathers one row of the untied input embedding instead of reading all
    # 1.05 GB of it, so the floor it must beat is 15.01 GB ÷ 3.35 TB/s = 4.48 ms
    read = r.weight_bytes - 2 * 128256 * 4096 + 2 * 4096
    assert batch1.step.weight_bytes == pytest.approx(read)
    assert batch1.step.time_s * 1e3 == pytest.approx(4.48, abs=0.01)
    assert batch1.step.bound == "memory"
    assert batch1.cost_per_1m_output_tokens == pytest.approx(
        3.0 / (batch1.tok_s_total * 3600) * 1e6)


def test_batch_64_reads_the_same_weights_for_64_tokens():
    r = report()
    one, sixty_four = r.rows
    assert sixty_four.step.weight_bytes == pytest.approx(one.step.weight_bytes, rel=1e-3)
    assert sixty_four.step.kv_bytes == pytest.approx(64 * one.step.kv_bytes)
    assert sixty_four.step.flops == pytest.approx(64 * one.step.flops)
    assert sixty_four.tok_s_total > 30 * one.tok_s_total
    assert sixty_four.step.bound == "memory"  # 39 FLOP/byte, ridge 295


def test_max_batch_and_prefill():
    r = report()
    per_sequence = 1280 * 131_072
    assert r.kv_bytes_per_sequence == per_sequence
    assert r.max_batch == int((0.9 * 80e9 - 16_060_522_496) // per_sequence) == 333
    assert r.prefill.bound == "compute"  # 1,024 tokens: ~960 FLOP/byte
    # 2 FLOPs per weight per token, LM head once, causal attention on top
    matmul = 2 * 1024 * (LLAMA.total_params() - 2 * 128256 * 4096) + 2 * 128256 * 4096
    assert r.prefill.flops > matmul
    assert r.prefill.time_s == pytest.approx(r.prefill.flops / 989.5e12)


def test_tensor_parallel_splits_the_floor():
    one, two = report(), report(num_gpus=2)
    assert two.rows[0].step.time_s == pytest.approx(one.rows[0].step.time_s / 2)
    assert two.cost_per_hour == 2 * one.cost_per_hour
    assert two.max_batch > 2 * one.max_batch  # the weights are paid for once


def test_weights_that_do_not_fit_are_flagged():
    big = ModelArch.from_config(preset_config("llama-3-70b"))
    r = analyze(big, BF16, H100, batches=[1], prompt_len=128, output_len=128, context=256,
                kv_dtype="bf16")
    assert r.max_batch == 0
    assert not r.rows[0].fits
    assert any("do not fit" in note for note in r.notes)
