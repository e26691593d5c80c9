"""triton_moe: the fused-MoE kernel (sorted token -> expert blocks, one launch per
projection) against the grouped torch path, in fp32 under the interpreter (bf16 on a
GPU), with model-dtype weights and with e4m3 weights and per-channel scales."""

from __future__ import annotations

import pytest
import torch

from tokenmill.models.moe_compute import grouped_experts, route
from tokenmill.quant import fp8


@pytest.fixture
def moe(kernel_device):
    from tokenmill.kernels import triton_moe

    return triton_moe


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.1
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, True)
    return x, w13, w2, weights, ids


def test_align_pairs_gives_each_block_one_expert(moe):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    sorted_pairs, block_expert, total = moe.align_pairs(ids, 4, block_m=16)
    assert int(total) == 48  # experts 0, 1, 3 each padded to one block of 16
    blocks = sorted_pairs.view(-1, 16)
    flat = ids.flatten()
    for b in range(3):
        real = blocks[b][blocks[b] < 6]
        assert real.numel() and (flat[real.long()] == block_expert[b]).all()
    assert sorted(blocks[:3][blocks[:3] < 6].tolist()) == list(range(6))


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (7, 8, 2), (4, 128, 8)])
def test_matches_the_grouped_experts(moe, kernel_device, tokens, experts, top_k):
    """Ragged sizes (hidden 80, intermediate 48: neither a multiple of a tile); batch 1,
    a few tokens, and Qwen3-MoE's 128 experts top-8 with most experts idle."""
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, 80, 48, seed=tokens)
    want = grouped_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
    dtype = torch.bfloat16 if kernel_device.type == "cuda" else torch.float32
    dev = kernel_device
    got = moe.fused_moe(x.to(dev, dtype), w13.to(dev, dtype), w2.to(dev, dtype),
                        weights.to(dev), ids.to(dev))
    assert got.shape == x.shape and got.dtype == dtype
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)


def test_fp8_weights_with_per_channel_scales(moe, kernel_device):
    x, w13, w2, weights, ids = _case(5, 8, 2, 64, 32, seed=3)
    q13, s13 = fp8.quantize_rows(w13.reshape(-1, 64))
    q2, s2 = fp8.quantize_rows(w2.reshape(-1, 32))
    deq13 = (q13.double() * s13.double()).view(w13.shape)
    deq2 = (q2.double() * s2.double()).view(w2.shape)
    want = grouped_experts(x.double(), deq13, deq2, weights.double(), ids)
    cuda = kernel_device.type == "cuda"
    codes = fp8.FP8 if cuda else torch.float32
    dtype = torch.bfloat16 if cuda else torch.float32
    dev = kernel_device
    got = moe.fused_moe(x.to(dev, dtype), q13.float().view(w13.shape).to(dev, codes),
                        q2.float().view(w2.shape).to(dev, codes), weights.to(dev), ids.to(dev),
                        s13.view(8, 64).to(dev), s2.view(8, 64).to(dev))
    tol = 3e-2 if cuda else 1e-5
    torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)
