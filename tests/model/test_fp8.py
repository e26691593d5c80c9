"""fp8 weights (quant/fp8.py): the quantize/dequantize round trip within e4m3's
bound, the linear's math on CPU, a clear error where there is no fp8. The
torch._scaled_mm call itself runs only on a GPU (benchmarks/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.quant import quantize_model, resolve_method
from tokenmill.quant.fp8 import (
    FP8_MAX,
    Fp8Linear,
    dequantize_rows,
    fp8_unavailable_reason,
    quantize_rows,
)


def test_round_trip_within_e4m3_bound():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # rows' scales differ
    w[3] = 0.0
    codes, scale = quantize_rows(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    back = dequantize_rows(codes, scale)
    assert torch.equal(back[3], torch.zeros(256))
    # 3 mantissa bits, round to nearest: half an ulp is 2^-4 of a normal value; below
    # the smallest normal (2^-6) the spacing is 2^-9, in units of the row's scale
    bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
    assert ((back - w).abs() <= bound).all()
    assert (codes.float().abs().amax(dim=1)[scale[:, 0] > 1e-12] == FP8_MAX).all()


def test_fp8_linear_matches_the_float_linear_within_the_bound():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(48, 128, generator=g), torch.randn(48, generator=g)
    x = torch.randn(5, 128, generator=g)
    y = Fp8Linear(w.bfloat16(), b.bfloat16())(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (5, 48)
    ref = x @ w.t() + b
    # each operand within 2^-4 relative: the products within ~2^-3, over random signs
    assert (y.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_quantize_model_swaps_all_but_the_lm_head():
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv_proj = nn.Linear(32, 48, bias=False).bfloat16()
            self.lm_head = nn.Linear(32, 100, bias=False).bfloat16()

    model = Tiny()
    summary = quantize_model(model, "fp8")
    assert isinstance(model.qkv_proj, Fp8Linear) and summary.quantized == ["qkv_proj"]
    assert isinstance(model.lm_head, nn.Linear)


def test_a_width_scaled_mm_cannot_take_stays_float_and_says_why():
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv_proj = nn.Linear(32, 48, bias=False).bfloat16()
            self.o_proj = nn.Linear(40, 32, bias=False).bfloat16()  # 40: not a multiple of 16

    model = Tiny()
    summary = quantize_model(model, "fp8")
    assert isinstance(model.qkv_proj, Fp8Linear) and summary.quantized == ["qkv_proj"]
    assert isinstance(model.o_proj, nn.Linear)
    assert "divisible by 16, not (32, 40)" in summary.kept_float["o_proj"]


def test_fp8_on_a_cpu_is_a_clear_error():
    assert "compute capability 8.9" in fp8_unavailable_reason(torch.device("cpu"))
    model = nn.Linear(16, 16).bfloat16()
    with pytest.raises(ValueError, match="--quantization fp8: fp8 weights need a CUDA GPU"):
        resolve_method("fp8", model)
