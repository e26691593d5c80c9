"""triton_gguf_gemm: a linear read straight from GGUF blocks (Q8_0, Q4_0, Q4_K, Q6_K)
against the `gguf` package's dequantization times the same activations in float64, on
random blocks (any bit pattern is a block; the fp16 scales are set to sane values so no
inf/NaN), ragged N and row counts. fp32 under the interpreter; bf16 on a GPU."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

# where each type keeps its fp16 scales, and a value giving weights of order 0.1
SCALES = {"Q8_0": (34, {0: 0.1 / 127}), "Q4_0": (18, {0: 0.1 / 8}),
          "Q4_K": (144, {0: 0.15 / (63 * 15), 2: 0.15 / (63 * 15)}),
          "Q6_K": (210, {208: 0.15 / (128 * 32)})}


@pytest.fixture
def gemm(kernel_device):
    from tokenmill.kernels import triton_gguf_gemm

    return triton_gguf_gemm


def random_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 (n, bytes per row) of random blocks with sane scales."""
    block_bytes, scales = SCALES[qtype]
    qk = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n * k // qk, block_bytes), dtype=np.uint8)
    for offset, value in scales.items():
        blocks[:, offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return blocks.reshape(n, k // qk * block_bytes)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 40, 512), (5, 33, 768), (17, 64, 256)])
def test_matches_the_dequantized_product(gemm, kernel_device, qtype, rows, n, k):
    """N not a multiple of the 32-column tile, K a few super-blocks (768: three), 1-17
    rows (padded to 16 or 32 inside)."""
    blocks = random_blocks(qtype, n, k, seed=rows)
    w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    assert w.shape == (n, k) and np.isfinite(w).all()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = x.double() @ torch.from_numpy(w).double().T
    dtype = torch.bfloat16 if kernel_device.type == "cuda" else torch.float32
    y = gemm.gguf_gemm(x.to(kernel_device, dtype), torch.from_numpy(blocks).to(kernel_device),
                       qtype, k)
    assert y is not None and y.shape == (rows, n) and y.dtype == dtype
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.double().cpu(), want, atol=tol, rtol=tol)


def test_nan_rows_past_the_batch_do_not_leak(gemm, kernel_device):
    """x is a view of a NaN-filled buffer: only its first rows are the batch's."""
    blocks = torch.from_numpy(random_blocks("Q4_K", 32, 256, seed=0)).to(kernel_device)
    buf = torch.full((16, 256), float("nan"), device=kernel_device)
    buf[:2] = torch.randn(2, 256)
    y = gemm.gguf_gemm(buf[:2], blocks, "Q4_K", 256)
    assert torch.isfinite(y).all()


def test_declines_what_it_does_not_take(gemm, kernel_device):
    blocks = torch.from_numpy(random_blocks("Q8_0", 8, 64, seed=0)).to(kernel_device)
    x = torch.randn(80, 64, device=kernel_device)
    assert gemm.gguf_gemm(x, blocks, "Q8_0", 64) is None  # more rows than a decode batch
    assert gemm.gguf_gemm(x[:1], blocks, "Q5_K", 64) is None  # a type it lacks
