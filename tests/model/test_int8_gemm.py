"""Issue 21: the w8a8 batched linears (int8 weights x per-token int8 activations on
AVX512-VNNI, tokenmill/kernels/int8_gemm.c) against their torch reference on the real
shapes of SmolLM2-135M, ragged batches included, and swapped into a model.

Documented tolerance (tokenmill/quant/int8_dynamic.py): the kernel equals `reference`
(the same codes, summed exactly in fp64) within one bf16 rounding of the output; against
the unquantized bf16 matmul the error is the two 8-bit roundings: 1-3% here (rows
with outlier channels, whose range coarsens every other value of the row)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests.model.conftest import make_hf_model, write_tiny_gguf
from tokenmill.loaders import load_model
from tokenmill.quant import QuantizedLinear, quantize_model
from tokenmill.quant import int8_dynamic as w8a8
from tokenmill.quant.model import resolve_batched_linears

pytestmark = pytest.mark.skipif(not w8a8.available(),
                                reason="int8 GEMM kernel not built (no compiler / no VNNI)")

SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072),
          "down": (1536, 576), "lm_head": (576, 49152)}  # (in_features K, out_features N)


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows like a decoder's: skewed, a few outlier channels, one row of zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) + 0.2
    x[:, :: k // 7] *= 12.0  # outlier channels
    if m > 2:
        x[1] = 0.0
    return x.bfloat16()


def _within_one_bf16_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.float(), want.float()
    # the same codes and exact sums: only the fp32 scaling and the bf16 rounding differ
    ulp = 2.0 ** -7 * torch.maximum(got.abs(), want.abs())  # one bf16 step at the value
    assert ((got - want).abs() <= ulp).all(), (got - want).abs().max()


@functools.cache
def _weight(shape: str):
    k, n = SHAPES[shape]
    weight = (torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
              ).bfloat16()
    return weight, w8a8.Int8DynamicWeight(weight), *w8a8.quantize_weight(weight)


@pytest.mark.parametrize("rows", [16, 17, 32, 64])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_kernel_matches_the_reference_on_the_real_shapes(shape, rows):
    k, n = SHAPES[shape]
    weight, lin, codes, scale = _weight(shape)
    x = _activations(rows, k, seed=rows)
    y = lin(x)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    cols = torch.arange(0, n, max(1, n // 3072))  # every column but the LM head's (fp64)
    _within_one_bf16_rounding(y[:, cols], w8a8.reference(x, codes[cols], scale[cols]))
    assert (y[1] == 0).all()  # a zero row stays zero
    exact = x.float() @ weight[cols].float().t()
    # the 8-bit roundings, the activations' dominating: their range spans the outliers
    assert float((y[:, cols].float() - exact).norm() / exact.norm()) < 0.04


@pytest.mark.parametrize(("k", "n", "rows"), [(64, 40, 9), (32, 16, 1), (1536, 17, 3)])
def test_kernel_takes_any_out_features_and_row_count(k, n, rows):
    # the channel tail (n % 48, n % 16) and row tails (rows % 8) take masked paths
    weight = (torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.1).bfloat16()
    x = _activations(rows, k, seed=2)
    codes, scale = w8a8.quantize_weight(weight)
    _within_one_bf16_rounding(w8a8.Int8DynamicWeight(weight)(x),
                              w8a8.reference(x, codes, scale))


def test_in_features_the_kernel_cannot_take_are_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        w8a8.Int8DynamicWeight(torch.ones(16, 40, dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def tiny_bf16_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("w8a8-gguf") / "tiny.gguf"
    return write_tiny_gguf(make_hf_model("llama", tie_word_embeddings=True), path)


def _logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)))).float()


def test_model_runs_w8a8_from_eight_rows_and_int4_below(tiny_bf16_gguf):
    loaded = load_model(tiny_bf16_gguf, dtype="bfloat16")
    reference = copy.deepcopy(loaded.model)
    bf16_large = copy.deepcopy(loaded.model)
    quantize_model(bf16_large, "gguf", dense_min_rows=8)
    summary = quantize_model(loaded.model, "gguf", dense_min_rows=8, batched_linears="w8a8")
    linears = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 9  # the tied LM head included
    assert all(isinstance(m.dense, w8a8.Int8DynamicWeight) for m in linears)
    # int8 codes: about half the bytes of the bf16 copies
    assert summary.dense_bytes < 0.6 * sum(m.in_features * m.out_features * 2 for m in linears)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(5))
    want = _logits(reference, ids)
    got = _logits(loaded.model, ids)  # 12 rows: the w8a8 path
    assert not torch.equal(got, _logits(bf16_large, ids))
    assert float((got - want).norm() / want.norm()) < 0.05
    # 4 rows: the int4 path, as with bf16 large-batch weights
    assert torch.equal(_logits(loaded.model, ids[:4]), _logits(bf16_large, ids[:4]))


def test_the_flag_is_checked_against_the_model():
    assert resolve_batched_linears("bf16", "gguf", torch.bfloat16) == "bf16"
    assert resolve_batched_linears("w8a8", "gguf", torch.bfloat16) == "w8a8"
    assert resolve_batched_linears("auto", "none", torch.float32) == "bf16"
    with pytest.raises(ValueError, match="--batched-linears w8a8 .* bfloat16 model"):
        resolve_batched_linears("w8a8", "gguf", torch.float32)  # the exact fp32 path
    with pytest.raises(ValueError, match="--batched-linears w8a8 .* bfloat16 model"):
        resolve_batched_linears("w8a8", "none", torch.bfloat16)
    with pytest.raises(ValueError, match="--batched-linears 'int4'"):
        resolve_batched_linears("int4", "gguf", torch.bfloat16)
