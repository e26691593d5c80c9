"""The default weight choice (`dtype="auto"`, no --quantization) and --quantization
int8 / int4 through the engine, on a tiny GGUF written by the tests."""

from __future__ import annotations

import pytest
import torch

from tests.model.conftest import make_hf_model, write_tiny_gguf
from tokenmill.engine.runner import weights
from tokenmill.loaders import resolve_model
from tokenmill.quant import default_arithmetic, mlp_int8, vnni
from tokenmill.quant.default_arithmetic import default_gguf_arithmetic
from tokenmill.quant.linear import Int4Linear, Int8Linear, QuantizedLinear
from tokenmill.quant.model import DENSE_MIN_ROWS, VNNI_DENSE_MIN_ROWS


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("auto-gguf") / "tiny.gguf"
    return str(write_tiny_gguf(make_hf_model("llama"), path))


def _linears(model) -> list[QuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def test_auto_on_a_native_bf16_cpu_is_bf16_with_int4_below_8_rows(tiny_gguf, monkeypatch):
    monkeypatch.setattr(weights, "cpu_has_native_bf16", lambda: True)
    loaded, method = weights.load_engine_model(resolve_model(tiny_gguf), "auto", None,
                                               torch.device("cpu"))
    # the CPU's default records (default_arithmetic.py: gguf-a8 on AVX512-VNNI, gguf-a16
    # on AVX2, gguf without the kernel)
    assert loaded.dtype == torch.bfloat16 and method == default_gguf_arithmetic().method
    linears = _linears(loaded.model)
    assert len(linears) == 9 and all(isinstance(m, Int4Linear) for m in linears)
    # below the threshold the low-bit kernel, from it the bf16 weights packed for
    # oneDNN: 8 rows for torch's int4 kernel, VNNI_DENSE_MIN_ROWS for gguf-a16's / a8's
    rows = VNNI_DENSE_MIN_ROWS if method in ("gguf-a16", "gguf-a8") else DENSE_MIN_ROWS
    assert DENSE_MIN_ROWS == 8 and VNNI_DENSE_MIN_ROWS > DENSE_MIN_ROWS
    assert all(m.dense is not None and m.dense_min_rows == rows for m in linears)
    m = linears[0]
    x = torch.randn(rows, m.in_features, dtype=torch.bfloat16)
    assert torch.equal(m(x), m.dense(x))  # from the threshold: the bf16 weights
    below = x[:rows - 1]
    assert torch.equal(m(below), m._lowbit(below))  # one row fewer: the low-bit kernel
    assert not torch.equal(m(below), m.dense(below))


def test_auto_on_avx512_vnni_runs_the_mlps_large_batches_on_their_own_records(
        tiny_gguf, monkeypatch):
    """On AVX512-VNNI (where `--batched-linears mlp-int8` passed the accuracy gate on
    every gated file) the MLP's gate_up and down take large batches on their own records
    at 8-bit activations, keeping no float copy; the attention's linears keep packed
    bf16."""
    if not mlp_int8.available():
        pytest.skip("needs q4q8_gemv built with AVX512-VNNI")
    monkeypatch.setattr(weights, "cpu_has_native_bf16", lambda: True)
    monkeypatch.delenv(default_arithmetic.FORCE_ENV, raising=False)
    loaded, method = weights.load_engine_model(resolve_model(tiny_gguf), "auto", None,
                                               torch.device("cpu"))
    assert method in ("gguf-a8", "gguf-a16")
    kinds = {}
    for name, m in loaded.model.named_modules():
        if isinstance(m, QuantizedLinear):
            leaf = name.rpartition(".")[2]
            mlp = leaf in mlp_int8.MLP_LINEARS
            kinds[leaf] = type(m.dense).__name__
            assert isinstance(m.dense, mlp_int8.Int8ActivationWeight) == mlp, name
            x = torch.randn(VNNI_DENSE_MIN_ROWS, m.in_features, dtype=torch.bfloat16)
            assert torch.equal(m(x), m.dense(x))
    assert {"gate_up_proj", "down_proj", "qkv_proj"} <= set(kinds), kinds


def test_auto_on_an_avx2_cpu_is_bf16_on_the_int16_kernel_at_every_batch(tiny_gguf,
                                                                        monkeypatch):
    """No native bf16 but the kernel's AVX2 dot products: the model runs bf16 on
    gguf-a16, and from VNNI_DENSE_MIN_ROWS rows on the linears' own integers widened to
    int16 (widened.py), with the per-row kernel's bits. A build whose kernel is not AVX2
    (AVX512-VNNI) keeps fp32 dense weights there (oneDNN emulates bf16 matmuls), giving
    what a bf16 matmul with fp32 accumulation gives."""
    from tokenmill.quant import dense, widened

    if not vnni.available():
        pytest.skip("q4q8_gemv not built")
    monkeypatch.setattr(weights, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(dense, "has_native_bf16", lambda: False)
    monkeypatch.setattr(vnni, "fast", lambda: True)
    monkeypatch.setattr(default_arithmetic, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setattr(mlp_int8, "available", lambda: False)  # no VNNI: no mlp-int8
    monkeypatch.delenv(default_arithmetic.FORCE_ENV, raising=False)
    loaded, method = weights.load_engine_model(resolve_model(tiny_gguf), "auto", None,
                                               torch.device("cpu"))
    assert loaded.dtype == torch.bfloat16 and method == "gguf-a16"
    linears = _linears(loaded.model)
    assert all(m.dense_min_rows == VNNI_DENSE_MIN_ROWS for m in linears)
    on_kernel = [m for m in linears if m.activations == "int16"]
    assert on_kernel  # (linears with no exact record form keep bf16 inputs and dense weights)
    for m in linears:
        if widened.available() and m in on_kernel:
            assert isinstance(m.dense, widened.WidenedWeight)
        else:
            assert m.dense.dtype == torch.float32
        x = torch.randn(VNNI_DENSE_MIN_ROWS, m.in_features, dtype=torch.bfloat16)
        y = m(x)
        assert y.dtype == torch.bfloat16
        if isinstance(m.dense, widened.WidenedWeight):
            assert torch.equal(y, m._lowbit(x))  # the per-row kernel's bits, at many rows
        else:
            bf16_weight = dense.DenseWeight(_dense_bf16(m), torch.bfloat16)
            torch.testing.assert_close(y, bf16_weight(x), rtol=1e-2, atol=1e-2)
        assert torch.equal(m(x[:-1]), m._lowbit(x[:-1]))  # below the threshold: the kernel


def _dense_bf16(m: QuantizedLinear) -> torch.Tensor:
    """m's large-batch weight as bf16 (exact: it was widened from bf16)."""
    eye = torch.eye(m.in_features, dtype=torch.bfloat16)
    return m.dense(eye).t().contiguous()


def test_auto_elsewhere_keeps_float32_weights_and_float32_asks_for_the_reference(
        tiny_gguf, monkeypatch):
    monkeypatch.setattr(weights, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(vnni, "fast", lambda: False)
    loaded, method = weights.load_engine_model(resolve_model(tiny_gguf), "auto", None,
                                               torch.device("cpu"))
    assert loaded.dtype == torch.float32
    assert all(m.dense is None for m in _linears(loaded.model))  # no bf16 copy kept
    exact, method = weights.load_engine_model(resolve_model(tiny_gguf), "float32", None,
                                              torch.device("cpu"))
    assert method == "none" and _linears(exact.model) == []


@pytest.mark.slow
@pytest.mark.parametrize("method, cls", [("int8", Int8Linear), ("int4", Int4Linear)])
def test_quantization_flag_through_the_engine(method, cls):
    """--quantization int8|int4 on the embedded model: every target linear is swapped and
    greedy decoding still says what the fp32 reference says first."""
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = "The capital of France is"
    ref = LLM("smollm2-135m", dtype="float32", num_kv_blocks=16).generate(
        [prompt], params, use_tqdm=False)[0].outputs[0]
    llm = LLM("smollm2-135m", dtype="float32", quantization=method, num_kv_blocks=16)
    linears = _linears(llm.engine.runner.model)
    assert len(linears) == 30 * 4 + 1 and all(isinstance(m, cls) for m in linears)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4
    assert out.token_ids[0] == ref.token_ids[0]  # " Paris": a margin no quantization flips
