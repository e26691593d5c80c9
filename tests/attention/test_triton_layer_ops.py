"""The layer ops' Triton kernels (tokenmill/kernels/triton_layer_ops.py: what a CUDA
step runs for RMSNorm + residual, rotary, SiLU * up and fp8's activation scales)
against the torch ops they replace, the model's own fallback code. Under the
interpreter in fp32 and fp16; compiled on a GPU where CUDA is present, bf16 too
(the interpreter's bf16 and fp8 casts truncate)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import layer_ops
from tokenmill.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from tokenmill.quant import fp8

# the fallback and the kernel compute the same fp32 values up to a row sum's order:
# at most one step of the activation dtype apart after rounding
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}


def dtypes(device: torch.device) -> list[torch.dtype]:
    cuda = device.type == "cuda"
    return [torch.float32, torch.float16] + ([torch.bfloat16] if cuda else [])


@pytest.fixture
def ops(kernel_device):
    from tokenmill.kernels import triton_layer_ops

    return triton_layer_ops


@pytest.fixture
def torch_ops(monkeypatch):
    """The model's layers with the fused kernels turned off: their plain torch ops."""
    monkeypatch.setattr(layer_ops, "rms_norm", lambda *a, **k: None)
    monkeypatch.setattr(layer_ops, "rotary_", lambda *a, **k: False)
    monkeypatch.setattr(layer_ops, "silu_mul", lambda *a, **k: None)


@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (5, 64), (3, 4096)])
def test_rms_norm_with_and_without_the_residual_add(ops, kernel_device, torch_ops, rows, hidden):
    for dtype in dtypes(kernel_device):
        g = torch.Generator().manual_seed(rows)
        norm = RMSNorm(hidden, 1e-5).to(kernel_device, dtype)
        norm.weight.data.copy_(torch.rand(hidden, generator=g) + 0.5)
        x = (torch.randn(rows, hidden, generator=g) * 3).to(kernel_device, dtype)
        res = torch.randn(rows, hidden, generator=g).to(kernel_device, dtype)
        want = norm(x)
        want_add, want_res = norm.add_forward(x, res.clone())
        atol, rtol = TOL[dtype]
        got = ops.rms_norm(x, norm.weight, norm.eps)
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
        xs, rs = x.clone(), res.clone()
        got_add = ops.rms_norm(xs, norm.weight, norm.eps, rs)
        assert got_add.data_ptr() == xs.data_ptr()  # written over x
        torch.testing.assert_close(rs, want_res, atol=0, rtol=0)  # the residual, in place
        torch.testing.assert_close(got_add, want_add, atol=atol, rtol=rtol)


def test_rotary_in_place_on_the_qkv_projection_view(ops, kernel_device, torch_ops):
    """q and k rotate together as the model hands them: a strided view of the fused
    qkv output (9 + 3 heads of 64, then v), at scattered positions."""
    rotary = RotaryEmbedding(64, 4096, 10000.0).to(kernel_device)
    for dtype in dtypes(kernel_device):
        g = torch.Generator().manual_seed(1)
        qkv = torch.randn(7, (9 + 3 + 3) * 64, generator=g).to(kernel_device, dtype)
        qk = qkv[:, : 12 * 64].unflatten(-1, (12, 64))
        positions = torch.tensor([0, 1, 17, 300, 301, 4095, 2], device=kernel_device)
        want = rotary.rotate(positions, qk.clone())
        v_before = qkv[:, 12 * 64:].clone()
        rotary._step = None
        assert ops.rotary_(qk, positions, rotary.cos_cache, rotary.sin_cache)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(qk, want, atol=atol, rtol=rtol)
        torch.testing.assert_close(qkv[:, 12 * 64:], v_before, atol=0, rtol=0)  # v untouched


def test_silu_mul_over_several_column_blocks(ops, kernel_device, torch_ops):
    for dtype in dtypes(kernel_device):
        g = torch.Generator().manual_seed(2)
        gate_up = (torch.randn(3, 2 * 1536, generator=g) * 4).to(kernel_device, dtype)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(ops.silu_mul(gate_up), silu_and_mul(gate_up),
                                   atol=atol, rtol=rtol)


def test_fp8_row_scales_codes_and_padding(ops, kernel_device):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 3000, generator=g) * torch.logspace(-3, 2, 5)[:, None])
    x[2] = 0  # an all-zero row keeps a positive scale
    x = x.to(kernel_device, torch.bfloat16 if kernel_device.type == "cuda" else torch.float32)
    want_codes, want_scale = fp8.quantize_rows(x)
    codes, scale = ops.quantize_rows_fp8(x, 16)
    assert codes.shape == (16, 3000) and codes.dtype == fp8.FP8 and scale.shape == (16, 1)
    torch.testing.assert_close(scale[:5], want_scale, atol=0, rtol=0)
    assert scale[2].item() == pytest.approx(1e-12)
    assert (scale[5:] == 1).all() and (codes[5:].float() == 0).all()  # _scaled_mm's padding
    if kernel_device.type == "cuda":  # the hardware's cast rounds as torch's does
        torch.testing.assert_close(codes[:5].float(), want_codes.float(), atol=0, rtol=0)
    # the values before the cast (the interpreter's e4m3 cast is wrong: checked above on a GPU)
    values, _ = ops.quantize_rows_fp8(x, 16, codes_dtype=torch.float32)
    want = (x.float() / want_scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX)
    torch.testing.assert_close(values[:5], want, atol=0, rtol=1e-6)
    assert values[:5].abs().amax(1)[[0, 1, 3, 4]].tolist() == pytest.approx([448.0] * 4)
