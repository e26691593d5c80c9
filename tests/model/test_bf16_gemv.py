"""The bf16 linear for a decode step's few rows (kernels/bf16_gemv.c) against fp32 math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import bf16_gemv
from tokenmill.models.layers import Linear

pytestmark = pytest.mark.skipif(not bf16_gemv.available(), reason="kernel not built here")


def _within_bf16_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                          b: torch.Tensor | None) -> None:
    """y is the fp32 sum rounded once to bf16: within half a bf16 step (2^-9 relative)
    of the exact value, plus fp32 summation order (far below it)."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    err = (y.double() - exact).abs()
    assert (err <= exact.abs() * 2.0 ** -8 + 1e-4).all(), err.max()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 21, 48])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (100, 70), (37, 1536)], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_match_the_exact_product_rounded_to_bf16(rows, n, k, bias):
    """Row counts of one pass (up to 8) and of several (two weight rows at a time, the
    last pass shorter), weights not a multiple of its 16-row groups (an odd count: a
    weight row without a pair) and inputs not of its 32-wide chunks (the masked tail),
    with and without a bias. Past max_rows() (8 without vdpbf16ps: AVX2) the call is
    not taken and says so (None), so the caller runs F.linear."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    y = bf16_gemv.linear(x, w, b)
    if rows > bf16_gemv.max_rows():
        assert y is None
        return
    _within_bf16_rounding(y, x, w, b)
    # torch's bf16 linear rounds the same sums (in another order): equal but for ties
    assert (y != F.linear(x, w, b)).float().mean() < 0.01


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_threads_take_every_row_once(threads):
    """The threads' runs of 16-row groups, the others' leftovers taken from the back
    (8 threads on 2 cores: some descheduled mid-run): the one-thread result, exactly."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 576, generator=g).bfloat16()
    w = torch.randn(49152 // 8 + 5, 576, generator=g).bfloat16()
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = bf16_gemv.linear(x, w)
        torch.set_num_threads(threads)
        for _ in range(3):
            assert torch.equal(bf16_gemv.linear(x, w), one)
    finally:
        torch.set_num_threads(saved)
    _within_bf16_rounding(one, x, w, None)


def test_what_it_does_not_take_goes_back_to_torch():
    w = torch.randn(64, 32).bfloat16()
    assert bf16_gemv.linear(torch.randn(bf16_gemv.max_rows() + 1, 32).bfloat16(), w) is None
    assert bf16_gemv.linear(torch.randn(2, 32), w.float()) is None  # fp32: the exact path
    assert bf16_gemv.linear(torch.randn(2, 32).bfloat16(), w.t().contiguous().t()) is None
    assert bf16_gemv.linear(torch.randn(2, 32).bfloat16(), w, torch.zeros(63).bfloat16()) is None


def test_a_linear_layer_runs_decode_rows_on_it_and_prompts_on_torch():
    layer = Linear(96, 40, bias=True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=g))
        layer.bias.copy_(torch.randn(40, generator=g))
    layer = layer.bfloat16()
    decode = torch.randn(1, 3, 96, generator=g).bfloat16()  # (batch, rows, K): 3 rows
    with torch.inference_mode():
        y = layer(decode)
        assert torch.equal(y, bf16_gemv.linear(decode, layer.weight, layer.bias))
        assert y.shape == (1, 3, 40)
        prompt = torch.randn(bf16_gemv.max_rows() + 1, 96, generator=g).bfloat16()
        assert torch.equal(layer(prompt), F.linear(prompt, layer.weight, layer.bias))


def test_a_build_without_avx512_bf16_gives_the_same_rounding():
    """Built for AVX2 (-march=x86-64-v3, the widened fp32 loop CPUs without vdpbf16ps
    run), the kernel's outputs are the exact product rounded once to bf16 too."""
    from tests.model.conftest import load_for_march

    fn = load_for_march(bf16_gemv._lib).tm_bf16_gemv
    g = torch.Generator().manual_seed(11)
    # 4 rows of x a weight row, then 1 at a time; 16 lanes and a tail (70, 1000 inputs)
    for rows, n, k in ((1, 100, 70), (5, 37, 576), (8, 37, 1000)):
        x = torch.randn(rows, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        b = torch.randn(n, generator=g).bfloat16()
        y = torch.empty(rows, n, dtype=torch.bfloat16)
        assert fn(x.data_ptr(), rows, k, w.data_ptr(), n, b.data_ptr(), y.data_ptr(), 2) == 0
        _within_bf16_rounding(y, x, w, b)
    # one pass of 8 rows at most there (its speed past that against oneDNN is unmeasured)
    x = torch.randn(9, 64, generator=g).bfloat16()
    y = torch.empty(9, 16, dtype=torch.bfloat16)
    assert fn(x.data_ptr(), 9, 64, w.data_ptr(), 16, None, y.data_ptr(), 2) == -1
