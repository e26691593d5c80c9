"""W4's prefill floor holds each FLOP against the fastest rate the default's prompt
kernels have for it on this CPU: int8 (twice bf16's) for the MLP where the MLP runs on
its records at 8 bits, for every linear on a Gemma 3 file; a floor no run may beat
(W4 read 0.96x of a bf16-only floor on the ~1B file)."""

from __future__ import annotations

import gguf
import pytest

from benchmarks import floors

PREFILL = {"flops": 1000e9, "attention_linear_flops": 200e9, "memory_time_s": 0.01,
           "ttft_floor_ms": 1000e9 / 0.5e12 * 1e3}


@pytest.fixture
def fixed_roofline(monkeypatch):
    monkeypatch.setattr(floors, "roofline", lambda *a, **k: {"prefill": PREFILL})


def test_int8_share_lowers_the_floor_by_the_int8_rate(fixed_roofline):
    tflop_s = 0.5
    assert floors.prefill_floor_ms(512, tflop_s) == pytest.approx(2000.0)
    # the attention's linears at bf16, the other 800 GFLOP at twice the rate
    assert floors.prefill_floor_ms(512, tflop_s, int8_share="mlp") == pytest.approx(400 + 800)
    assert floors.prefill_floor_ms(512, tflop_s, int8_share="all") == pytest.approx(1000.0)


def _gguf(path, arch: str) -> str:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_the_share_follows_the_file_and_the_cpu(tmp_path, monkeypatch):
    from tokenmill.quant import mlp_int8

    gemma, llama = _gguf(tmp_path / "g.gguf", "gemma3"), _gguf(tmp_path / "l.gguf", "llama")
    monkeypatch.setattr(mlp_int8, "available", lambda: True)  # AVX512-VNNI
    assert floors.prefill_int8_share(gemma) == "all"
    assert floors.prefill_int8_share(llama) == "mlp"
    monkeypatch.setattr(mlp_int8, "available", lambda: False)  # AVX2
    assert floors.prefill_int8_share(llama) == "none"
