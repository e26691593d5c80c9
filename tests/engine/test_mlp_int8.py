"""Issue 21: `--batched-linears mlp-int8` — a prompt chunk's MLP linears (gate_up and
down, 20+ rows) on their own GGUF records times int8 activations (q4q8_gemv.c at 8
bits), the attention's linears and the LM head on packed bf16; through the real engine,
against the exact fp32 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.conftest import greedy_text, small_engine
from tokenmill.kernels import q4q8_gemv
from tokenmill.quant import Int4Linear, mlp_int8
from tokenmill.quant.dense import DenseWeight
from tokenmill.quant.embedding import RecordsEmbedding
from tokenmill.quant.model import dense_copy_bytes, resolve_batched_linears
from tokenmill.sampling_params import SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "data" / "opticks_book1.txt"
needs_vnni = pytest.mark.skipif(not mlp_int8.available(), reason="needs AVX512-VNNI")


@pytest.fixture(scope="module")
def engines():
    return {"mlp-int8": small_engine(quantization="gguf-a16", batched_linears="mlp-int8"),
            "bf16": small_engine(quantization="gguf-a16", batched_linears="bf16")}


def _linears(engine):
    return {n: m for n, m in engine.runner.model.named_modules() if isinstance(m, Int4Linear)}


@needs_vnni
def test_the_mlp_takes_its_records_at_8_bits_and_keeps_no_float_copy(engines):
    linears = _linears(engines["mlp-int8"])
    mlp = {n: m for n, m in linears.items() if n.rpartition(".")[2] in mlp_int8.MLP_LINEARS}
    assert len(mlp) == 60 and len(linears) == 30 * 4 + 1
    assert all(isinstance(m.dense, mlp_int8.Int8ActivationWeight) and m.dense_min_rows == 20
               and m.activations == "int16" for m in mlp.values())  # decode rows: int16
    assert all(isinstance(m.dense, DenseWeight) for n, m in linears.items() if n not in mlp)
    # the packed bf16 copies left are attention's and the LM head's: ~1/4 of the decoder's
    model = engines["mlp-int8"].runner.model
    kept, full = dense_copy_bytes(model), dense_copy_bytes(engines["bf16"].runner.model)
    mlp_bytes = sum(m.in_features * m.out_features * 2 for m in mlp.values())
    assert kept == full - mlp_bytes


@needs_vnni
def test_prompt_rows_are_the_8_bit_kernel_s_sums(engines):
    """One MLP linear at a prompt's 32 rows gives q4q8_gemv's 8-bit result bit for bit
    (not the bf16 matmul's, nor the 16-bit kernel's), and it stays within the 8-bit
    activations' error of the exact product with the dequantized weight."""
    lin = _linears(engines["mlp-int8"])["model.layers.2.mlp.gate_up_proj"]
    torch.manual_seed(0)
    x = torch.randn(32, lin.in_features).to(torch.bfloat16)
    got = lin(x)
    kernel8 = q4q8_gemv.linear(x, lin.vnni_packed, lin.out_features, lin.vnni_format, bits=8)
    kernel16 = q4q8_gemv.linear(x, lin.vnni_packed, lin.out_features, lin.vnni_format, bits=16)
    assert torch.equal(got, kernel8)
    assert not torch.equal(got, kernel16)
    exact = q4q8_gemv.linear(x, lin.vnni_packed, lin.out_features, lin.vnni_format,
                             out_dtype=torch.float32, bits=16).double()
    rel = (got.double() - exact).norm() / exact.norm()
    assert rel < 0.02  # 8-bit activations per block of 32: ~0.5-1% here
    assert lin(x[:8]).equal(kernel16[:8])  # fewer than 20 rows: the decode kernel (16 bits)


@needs_vnni
def test_greedy_answer_and_prompt_logprobs_stay_near_bf16(engines):
    prompt = TEXT.read_text()[:400]  # ~90 tokens: one prompt step of 90 rows
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0)
    got = {}
    for name, engine in engines.items():
        engine.add_request("p", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[name] = out
    lp = {n: torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]])
          for n, o in got.items()}
    assert len(lp["bf16"]) >= 60
    assert not torch.equal(lp["mlp-int8"], lp["bf16"])  # the prompt ran another kernel
    # the mean log-probability of the text moves by well under 1%
    assert float(lp["mlp-int8"].mean()) == pytest.approx(float(lp["bf16"].mean()), rel=0.01)
    for name, engine in engines.items():
        engine.add_request("q", "The capital of France is", SamplingParams(temperature=0,
                                                                           max_tokens=4))
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[name] = out
        assert "Paris" in got[name].outputs[0].text


@pytest.mark.slow
@needs_vnni
def test_a_prefill_s_top1_agrees_with_the_fp32_reference(engines):
    """Every position of two 128-token windows scored from one prefill (vLLM's
    prompt_logprobs): the 8-bit MLP keeps greedy top-1 with the exact fp32 model at the
    bf16 path's level (the gate itself, benchmarks/accuracy.py, asks 97% over 1,000)."""
    from tokenmill.engine.core.teacher_forced import score_prompts

    fp32 = small_engine(dtype="float32")
    ids = fp32.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    windows = [ids[:129], ids[129:258]]
    ref = score_prompts(fp32, windows)
    got = score_prompts(engines["mlp-int8"], windows)
    assert sum(len(w) for w in got.argmax) == 256
    assert got.agreement(ref) >= 0.95
    assert got.perplexity() == pytest.approx(ref.perplexity(), rel=0.02)


def test_mlp_int8_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="--batched-linears mlp-int8.*gguf-a16"):
        resolve_batched_linears("mlp-int8", "gguf", torch.bfloat16)
    with pytest.raises(ValueError, match="--batched-linears mlp-int8.*gguf-a16"):
        resolve_batched_linears("mlp-int8", "none", torch.bfloat16)
    if mlp_int8.available():
        assert resolve_batched_linears("mlp-int8", "gguf-a16", torch.bfloat16) == "mlp-int8"
    else:
        with pytest.raises(ValueError, match="--batched-linears mlp-int8 needs"):
            resolve_batched_linears("mlp-int8", "gguf-a16", torch.bfloat16)


def test_int8_takes_the_attention_linears_too_and_is_refused_where_it_cannot_run():
    """`--batched-linears int8`: every linear on its records at 8 bits for large batches,
    the attention's qkv_proj and o_proj and the LM head too; no float copy of any, and
    the tied embedding's rows read from the head's records (no float table); refused
    by name where mlp-int8 is."""
    with pytest.raises(ValueError, match="--batched-linears int8.*gguf-a16"):
        resolve_batched_linears("int8", "gguf", torch.bfloat16)
    if not mlp_int8.available():
        with pytest.raises(ValueError, match="--batched-linears int8 needs"):
            resolve_batched_linears("int8", "gguf-a16", torch.bfloat16)
        return
    engine = small_engine(quantization="gguf-a16", batched_linears="int8")
    linears = _linears(engine)
    assert len(linears) == 30 * 4 + 1
    assert all(isinstance(m.dense, mlp_int8.Int8ActivationWeight) and m.dense_min_rows == 20
               for m in linears.values())
    model = engine.runner.model
    assert dense_copy_bytes(model) == 0
    assert isinstance(model.model.embed_tokens, RecordsEmbedding)
    assert not any(p.numel() >= model.lm_head.in_features * model.lm_head.out_features
                   for p in model.parameters())  # no float table of the vocabulary left
    # the head's 8-bit records at a prompt's 24 rows: the per-row kernel's sums
    x = torch.randn(24, model.lm_head.in_features, generator=torch.Generator().manual_seed(3)
                    ).bfloat16()
    assert torch.equal(model.lm_head.forward_fp32(x), q4q8_gemv.linear(
        x, model.lm_head.vnni_packed, model.lm_head.out_features, model.lm_head.vnni_format,
        torch.float32, bits=8))
    assert "Paris" in greedy_text(engine, "The capital of France is", 4)


def test_auto_takes_int8_for_gemma3_on_gguf_a8_only():
    """--batched-linears auto on AVX512-VNNI: int8 for an architecture whose gguf-a8
    attention runs at int8 (config.GGUF_INT8_ATTENTION_ARCHITECTURES: Gemma 3, gated),
    mlp-int8 for the others and for gguf-a16."""
    if not mlp_int8.available():
        pytest.skip("needs AVX512-VNNI")

    def auto(method, arch):
        return resolve_batched_linears("auto", method, torch.bfloat16, True, 0, arch)
    assert auto("gguf-a8", "Gemma3ForCausalLM") == "int8"
    assert auto("gguf-a8", "Gemma3ForConditionalGeneration") == "int8"
    assert auto("gguf-a16", "Gemma3ForCausalLM") == "mlp-int8"
    assert auto("gguf-a8", "LlamaForCausalLM") == "mlp-int8"
    assert auto("gguf-a8", None) == "mlp-int8"
