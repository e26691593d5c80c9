"""Issue 22: the engine with an 8-bit KV cache (--kv-cache-dtype int8 / fp8) on the
embedded model: the same --kv-cache-memory holds about twice the blocks, the server says
which cache it runs, and teacher-forced greedy choices agree with the bf16 cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.conftest import greedy_text
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.engine.core.llm_engine import LLMEngine

TEXT = Path(__file__).resolve().parents[1] / "data" / "opticks_book1.txt"
BUDGET = 24 * 2**20


def _engine(kv_cache_dtype: str, **cache) -> LLMEngine:
    # gguf-a16 named: these tests isolate the cache's rounding. On gguf-a8 (the AVX-512
    # VNNI default since 2026-12-06) the teacher-forced top-1 agreement of the int8 cache
    # with the bf16 one read 0.941 (256 positions), the int8 activations' own near-tie
    # flips on top of the cache's; the accuracy gate judges each path against fp32
    return LLMEngine(EngineConfig(max_num_seqs=8, quantization="gguf-a16", cache=CacheConfig(
        kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False, **cache)))


@pytest.fixture(scope="module")
def engines():
    return {d: _engine(d, kv_cache_memory_bytes=BUDGET) for d in ("bfloat16", "int8")}


def test_the_same_budget_holds_about_twice_the_blocks(engines):
    bf16 = engines["bfloat16"].get_stats().num_total_blocks
    int8 = engines["int8"].get_stats().num_total_blocks
    # one byte a value plus a 4-byte scale per 64 values: 128 -> 68 bytes a row
    assert 1.8 <= int8 / bf16 <= 2.0, (bf16, int8)
    assert engines["int8"].runner.kv_cache_bytes <= BUDGET
    assert engines["int8"].runner.kv_cache_bytes > 0.95 * BUDGET


def test_fp8_budget_matches_int8():
    import torch

    from tokenmill.config import ModelConfig
    from tokenmill.kvcache.budget import choose_num_blocks

    model = ModelConfig("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64)
    counts = {d: choose_num_blocks(model, CacheConfig(kv_cache_memory_bytes=BUDGET,
                                                      kv_cache_dtype=d),
                                   torch.bfloat16, torch.device("cpu"), 2048, 8)
              for d in ("auto", "int8", "fp8", "fp8_e5m2")}
    assert counts["int8"] == counts["fp8"] == counts["fp8_e5m2"]
    assert 1.8 <= counts["int8"] / counts["auto"] <= 2.0


def test_server_info_names_the_kv_cache_dtype(engines):
    from tokenmill.engine.core.server_info import server_info

    info = server_info(engines["int8"])
    assert info["kv_cache_dtype"] == "int8"
    assert info["num_kv_blocks"] == engines["int8"].get_stats().num_total_blocks


def test_int8_cache_generates_text(engines):
    assert "Paris" in greedy_text(engines["int8"], "The capital of France is", 4)


def test_the_llm_class_takes_the_kv_cache_dtype():
    # vLLM's LLM(kv_cache_dtype=...): the same cache as the flag, decoded by the fused step
    from tokenmill import LLM, SamplingParams

    llm = LLM("smollm2-135m", kv_cache_dtype="int8", kv_cache_memory=8 * 2**20)
    assert llm.engine.get_stats().num_total_blocks > 8 * 2**20 // (30 * 2 * 3 * 16 * 128)
    assert llm.engine.runner.fused_decode is not None
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.slow
def test_int8_teacher_forced_top1_agrees_with_the_bf16_cache(engines):
    from tokenmill.engine.core.teacher_forced import score_windows

    ids = engines["bfloat16"].tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    windows = [ids[:129], ids[129:258]]  # 2 x 128 = 256 scored positions, each a decode step
    bf16 = score_windows(engines["bfloat16"], windows)
    int8 = score_windows(engines["int8"], windows)
    assert sum(len(w) for w in int8.argmax) == 256
    assert int8.agreement(bf16) >= 0.95
    assert int8.perplexity() == pytest.approx(bf16.perplexity(), rel=0.02)
