"""Issue 21: the embedded model on the int16-activation kernel (the default with
AVX512-VNNI, `--quantization gguf-a16`) and on the int8 one (`gguf-a8`, opt-in: it
misses the 97% top-1 gate), through the real engine, against the exact fp32 reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.conftest import greedy_text, small_engine
from tokenmill.kernels import q4q8_gemv
from tokenmill.quant import Int4Linear, widened
from tokenmill.quant.fused_mlp import FusedSiluMLP
from tokenmill.sampling_params import SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "data" / "opticks_book1.txt"
pytestmark = pytest.mark.skipif(not q4q8_gemv.available(), reason="q4q8_gemv not built")


@pytest.fixture(scope="module")
def engines():
    return {"gguf-a16": small_engine(quantization="gguf-a16"),
            "gguf-a8": small_engine(quantization="gguf-a8"),
            "fp32": small_engine(dtype="float32")}


@pytest.mark.parametrize(("method", "activations"), [("gguf-a16", "int16"), ("gguf-a8", "int8")])
def test_every_linear_runs_the_quantized_activation_kernel(engines, method, activations):
    engine = engines[method]
    assert engine.quantization == method
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 30 * 4 + 1  # qkv, o, gate_up, down per layer and the LM head
    # gguf-a8: the attention's linears on int16 (config.GGUF_ATTENTION_ACTIVATIONS: the
    # accuracy gate on this file), the MLP and the LM head on int8
    attention = {id(m) for name, m in engine.runner.model.named_modules()
                 if name.rpartition(".")[2] in ("qkv_proj", "o_proj")}
    assert len(attention) == 30 * 2
    assert all(m.activations == ("int16" if id(m) in attention else activations)
               for m in linears)
    # silu * up runs inside each down projection's call
    assert sum(isinstance(m, FusedSiluMLP) for m in engine.runner.model.modules()) == 30
    assert engines["fp32"].quantization == "none"  # the exact reference stays exact
    assert "Paris" in greedy_text(engine, "The capital of France is", 4)


def test_logits_keep_the_fp32_sums_a_greedy_choice_needs(engines):
    """The LM head's logits are its kernel's fp32 sums, not bf16: at a logit of ~16 bf16
    steps by 1/16, and the chat reply to "What is the capital of France?" once opened
    with "L" (token 60) where fp32 picks "The" (504), 0.08 apart: rounded, they tied
    and the lower id won. Against the exact fp32 model, the error is a small part of
    bf16's rounding (it comes from the int16 activations alone)."""
    torch.manual_seed(0)
    hidden = (torch.randn(5, 576) * 2).to(torch.bfloat16)
    exact = engines["fp32"].runner.model.compute_logits(hidden.float()).double()
    for name in ("gguf-a16", "gguf-a8"):
        got = engines[name].runner.model.compute_logits(hidden)
        assert got.dtype == torch.float32 and got.shape == (5, 49152)
        assert (got != got.bfloat16().float()).float().mean() > 0.9  # not bf16 values
    got = engines["gguf-a16"].runner.model.compute_logits(hidden).double()
    bf16_error = (exact - exact.bfloat16().double()).abs().mean()
    assert (got - exact).abs().mean() < bf16_error / 8


@pytest.fixture(scope="module")
def windows(engines):
    ids = engines["fp32"].tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    return [ids[:129], ids[129:258]]  # 2 x 128 = 256 scored positions, each a decode step


@pytest.fixture(scope="module")
def reference(engines, windows):
    from tokenmill.engine.core.teacher_forced import score_windows

    return score_windows(engines["fp32"], windows)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "top1"), [("gguf-a16", 0.95), ("gguf-a8", 0.93)])
def test_teacher_forced_top1_agrees_with_the_fp32_reference(engines, windows, reference,
                                                            method, top1):
    from tokenmill.engine.core.teacher_forced import score_windows

    ref = reference
    got = score_windows(engines[method], windows)
    assert sum(len(w) for w in got.argmax) == 256
    assert got.agreement(ref) >= top1
    assert got.perplexity() == pytest.approx(ref.perplexity(), rel=0.02)


@pytest.mark.skipif(not widened.available(), reason="gemm16 widens the records on AVX2")
def test_int16_batched_linears_score_a_prompt_as_the_per_row_kernel_does():
    """`--batched-linears int16` (the default for gguf-a16 on AVX2 without native bf16):
    a prompt's rows (20+) run on the linears' records widened to int16 (gemm16), with
    the per-row kernel's arithmetic, so every prompt token's logprob and the greedy
    continuation are those of the per-row kernel, bit for bit (the fp32 weights it
    replaces gave others)."""
    engine = small_engine(quantization="gguf-a16", batched_linears="int16")
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 30 * 4 + 1
    assert all(isinstance(m.dense, widened.WidenedWeight) and m.dense_min_rows == 20
               for m in linears)
    prompt = TEXT.read_text()[:400]  # ~90 tokens: one prompt step of 90 rows
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1, logprobs=1)

    def run():
        engine.add_request("p", prompt, params)
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                out = o
        return ([{t: lp.logprob for t, lp in d.items()} for d in out.prompt_logprobs[1:]],
                out.outputs[0].token_ids,
                [{t: lp.logprob for t, lp in d.items()} for d in out.outputs[0].logprobs])

    widened_run = run()
    assert len(widened_run[0]) >= 60
    saved = [(m.dense, m.dense_min_rows) for m in linears]
    try:
        for m in linears:  # every row on the per-row kernel
            m.dense, m.dense_min_rows = None, None
        per_row = run()
    finally:
        for m, (dense, rows) in zip(linears, saved, strict=True):
            m.dense, m.dense_min_rows = dense, rows
    assert widened_run == per_row
    assert run() == per_row  # and back on the widened weights


def test_int16_batched_linears_are_refused_where_they_cannot_run():
    from tokenmill.quant.model import resolve_batched_linears

    with pytest.raises(ValueError, match="--batched-linears int16.*gguf-a16"):
        resolve_batched_linears("int16", "gguf", torch.bfloat16)
    if widened.available():
        assert resolve_batched_linears("int16", "gguf-a16", torch.bfloat16) == "int16"
    else:
        with pytest.raises(ValueError, match="--batched-linears int16 needs"):
            resolve_batched_linears("int16", "gguf-a16", torch.bfloat16)
