"""A decode batch's linears with the step before them fused in
(tokenmill/kernels/triton_decode_linear.py) against what they replace: triton_layer_ops'
RMSNorm (+ residual) and SiLU * up kernels, then F.linear. Ragged shapes, a bias, rows
read from a larger NaN-filled buffer (rows past the batch are never read), the residual
left unwritten, and batches it does not take refused. Under the interpreter in fp32
and fp16; compiled on a GPU where CUDA is present, bf16 too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# the kernel and the separate ops compute the same fp32 values up to a sum's order:
# the product's rounding to the activation dtype, a step or two of it
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
SHAPES = [(1, 256, 200), (3, 320, 77), (16, 128, 64), (5, 200, 1000)]  # (rows, K, N)


def dtypes(device: torch.device) -> list[torch.dtype]:
    if device.type == "cuda":  # fp32 is refused there (tf32)
        return [torch.float16, torch.bfloat16]
    return [torch.float32, torch.float16]


@pytest.fixture
def kernels(kernel_device):
    from tokenmill.kernels import triton_decode_linear, triton_layer_ops

    return triton_decode_linear, triton_layer_ops


def _rows(g, m, k, dtype, device):
    """m rows of width k, a view into a buffer whose other rows and columns are NaN."""
    buf = torch.full((m + 2, k + 8), float("nan"))
    buf[:m, :k] = torch.randn(m, k, generator=g)
    return buf.to(device, dtype)[:m, :k]


def _weights(g, n, k, dtype, device):
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, dtype)
    return w, torch.randn(n, generator=g).to(device, dtype)


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_plain_linear_is_f_linear(kernels, kernel_device, m, k, n):
    dl, _ = kernels
    g = torch.Generator().manual_seed(m + k + n)
    for dtype in dtypes(kernel_device):
        x = _rows(g, m, k, dtype, kernel_device)
        w, b = _weights(g, n, k, dtype, kernel_device)
        for bias in (None, b):
            got = dl.linear(x, w, bias)
            torch.testing.assert_close(got, F.linear(x, w, bias), rtol=TOL[dtype][0],
                                       atol=TOL[dtype][1])


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_norm_then_linear_in_one_kernel(kernels, kernel_device, m, k, n):
    dl, lo = kernels
    g = torch.Generator().manual_seed(2 * m + k + n)
    for dtype in dtypes(kernel_device):
        x = _rows(g, m, k, dtype, kernel_device)
        residual = _rows(g, m, k, dtype, kernel_device)
        norm_w = (torch.rand(k, generator=g) + 0.5).to(kernel_device, dtype)
        w, b = _weights(g, n, k, dtype, kernel_device)
        x_before, res_before = x.clone(), residual.clone()
        # with the residual: r = x + residual, then the projection of norm(r)
        got, r = dl.norm_linear(x, residual, norm_w, 1e-5, w, b)
        want_r = res_before.clone()  # the separate kernel adds in place
        normed = lo.rms_norm(x_before.clone(), norm_w, 1e-5, want_r)  # written over
        torch.testing.assert_close(r, want_r, rtol=0, atol=0)  # the same rounding of x + res
        torch.testing.assert_close(got, F.linear(normed, w, b), rtol=TOL[dtype][0],
                                   atol=TOL[dtype][1])
        assert torch.equal(x, x_before) and torch.equal(residual, res_before)  # not written
        # the first layer's: no residual, r is x itself
        got, r = dl.norm_linear(x, None, norm_w, 1e-5, w, None)
        assert r is x
        want = F.linear(lo.rms_norm(x.contiguous(), norm_w, 1e-5), w)
        torch.testing.assert_close(got, want, rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_silu_mul_then_linear_in_one_kernel(kernels, kernel_device, m, k, n):
    dl, lo = kernels
    g = torch.Generator().manual_seed(3 * m + k + n)
    for dtype in dtypes(kernel_device):
        gate_up = _rows(g, m, 2 * k, dtype, kernel_device)
        w, b = _weights(g, n, k, dtype, kernel_device)
        got = dl.silu_mul_linear(gate_up, w, b)
        want = F.linear(lo.silu_mul(gate_up.contiguous()), w, b)
        torch.testing.assert_close(got, want, rtol=TOL[dtype][0], atol=TOL[dtype][1])


def test_what_it_does_not_take_is_refused(kernels, kernel_device):
    dl, _ = kernels
    w = torch.randn(64, 128, device=kernel_device)
    norm_w = torch.ones(128, device=kernel_device)
    big = torch.randn(dl.MAX_ROWS + 1, 128, device=kernel_device)  # a prefill's rows
    assert dl.linear(big, w, None) is None
    assert dl.norm_linear(big, None, norm_w, 1e-5, w, None) is None
    assert dl.silu_mul_linear(torch.randn(2, 256, device=kernel_device).half(), w, None) is None
    assert dl.silu_mul_linear(torch.randn(2, 255, device=kernel_device), w, None) is None
    x = torch.randn(2, 128, device=kernel_device)
    assert dl.linear(x, w.t().contiguous().t(), None) is None  # K not the inner stride
    if kernel_device.type == "cuda":  # fp32 on the GPU stays on cuBLAS (no tf32 rounding)
        assert dl.linear(x, w, None) is None
    assert dl.norm_linear(x, torch.randn(3, 128, device=kernel_device), norm_w, 1e-5, w,
                          None) is None


def test_column_tiles_give_every_sm_a_program():
    from tokenmill.kernels import triton_decode_linear as dl

    # Llama-3-8B on an H100 (132 SMs): o_proj and down 4,096 columns, qkv 6,144,
    # gate_up 28,672, the LM head 128,256
    assert [dl.block_n(n, 132) for n in (4096, 6144, 28672, 128256)] == [16, 32, 64, 64]
    assert dl.block_n(64, 132) == 16  # narrower than the GPU: the smallest tile
