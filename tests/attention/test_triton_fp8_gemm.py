"""triton_fp8_gemm: the fp8 linear of decode batches (up to 64 rows) against the
product it stands for, (x_codes . w_codes^T) * x_scale * w_scale + bias, computed
in float64. Under the interpreter the codes travel as float32 holding e4m3 values
(its e4m3 casts are wrong); on a GPU as e4m3, into bf16 outputs."""

from __future__ import annotations

import pytest
import torch

from tokenmill.quant import fp8


@pytest.fixture
def gemm(kernel_device):
    from tokenmill.kernels import triton_fp8_gemm

    return triton_fp8_gemm


def operands(rows: int, n: int, k: int, device: torch.device, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x_codes, x_scale = fp8.quantize_rows(torch.randn(rows, k, generator=g))
    w_codes, w_scale = fp8.quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    b = torch.randn(n, generator=g) if bias else None
    want = (x_codes.double() @ w_codes.double().T) * x_scale.double() * w_scale.double().T
    if b is not None:
        want = want + b.double()
    cuda = device.type == "cuda"
    codes_dtype = fp8.FP8 if cuda else torch.float32
    out_dtype = torch.bfloat16 if cuda else torch.float32
    pad = -rows % 16  # as quantize_rows_fp8 hands them over: zero rows to a multiple of 16
    x_codes = torch.cat([x_codes.float(), torch.zeros(pad, k)]).to(device, codes_dtype)
    x_scale = torch.cat([x_scale, torch.ones(pad, 1)]).to(device)
    w = (w_codes.float().to(device, codes_dtype), w_scale.reshape(1, -1).to(device))
    return x_codes, x_scale, w, None if b is None else b.to(device, out_dtype), out_dtype, want


@pytest.mark.parametrize(("rows", "num_sms"), [(1, 1), (5, 8), (16, 132), (33, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_scaled_product(gemm, kernel_device, rows, num_sms, bias):
    """Ragged N and K (200 x 1000: neither a multiple of its tile), one K split
    (num_sms 1) and several (8: four programs across N want more), 1-64 rows."""
    n, k = 200, 1000
    x_codes, x_scale, (w, w_scale), b, out_dtype, want = operands(rows, n, k, kernel_device,
                                                                  bias, seed=rows)
    splits, _ = gemm.splits_for(n, k, num_sms)
    assert (splits > 1) == (num_sms > 1)
    y = gemm.fp8_gemm(x_codes, x_scale, w, w_scale, b, out_dtype, rows, num_sms)
    assert y.shape == (rows, n) and y.dtype == out_dtype
    tol = 1e-2 if out_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double().cpu(), want, atol=tol, rtol=tol)


def test_declines_more_rows_than_a_decode_batch(gemm, kernel_device):
    x_codes, x_scale, (w, w_scale), _, out_dtype, _ = operands(80, 64, 256, kernel_device,
                                                               False)
    assert gemm.fp8_gemm(x_codes, x_scale, w, w_scale, None, out_dtype, 80, 8) is None


@pytest.mark.parametrize(("rows", "num_sms"), [(1, 1), (5, 8), (16, 132), (3, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_one_launch_gives_the_three_kernels_bits(gemm, kernel_device, rows, num_sms, bias):
    """fp8_linear (the activation scales and the split sums in the GEMM's launch) against
    quantize_rows_fp8, fp8_gemm and its reduce: the same bits, with K split (num_sms 8
    and 64) or not, and each split count back at zero for the next launch."""
    from tokenmill.kernels import triton_layer_ops

    n, k = 200, 1000
    g = torch.Generator().manual_seed(rows + num_sms)
    cuda = kernel_device.type == "cuda"
    act = torch.bfloat16 if cuda else torch.float32
    x = torch.randn(rows, k, generator=g).to(kernel_device, act)
    w_codes, w_scale = fp8.quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    w = w_codes.to(kernel_device) if cuda else w_codes.float()  # the interpreter: fp32 codes
    w_scale = w_scale.reshape(1, -1).contiguous().to(kernel_device)
    b = torch.randn(n, generator=g).to(kernel_device, act) if bias else None
    codes, x_scale = triton_layer_ops.quantize_rows_fp8(x, fp8.FP8_DIM_MULTIPLE, w.dtype)
    want = gemm.fp8_gemm(codes, x_scale, w, w_scale, b, act, rows, num_sms)
    got = gemm.fp8_linear(x, w, w_scale, b, num_sms)
    assert torch.equal(got, want)
    if gemm.splits_for(n, k, num_sms)[0] > 1:
        assert not gemm._COUNTERS[x.device].any()


def test_one_launch_declines_more_than_sixteen_rows(gemm, kernel_device):
    x = torch.randn(gemm.FUSED_MAX_ROWS + 1, 256, device=kernel_device)
    w_codes, w_scale = fp8.quantize_rows(torch.randn(64, 256))
    assert gemm.fp8_linear(x, w_codes.float().to(kernel_device),
                           w_scale.reshape(1, -1).contiguous().to(kernel_device), None,
                           8) is None
