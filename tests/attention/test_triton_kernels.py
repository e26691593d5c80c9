"""Every triton kernel against the torch reference under the interpreter, fp32 and fp16:
mixed batches of decodes and prefill chunks over cached prefixes, fragmented block
tables, GQA 9/3, 32/8, 8/1 (and a group wider than one program), head_dim 64 and 128,
split-K on and off, and NaN in every unused slot of the pools. bf16 is proven by the
compile test: tl.dot on bf16 is wrong under the interpreter. Where CUDA is present the
same tests run compiled on the GPU (fp16, bf16; head_dim 64/128)."""

from __future__ import annotations

import pytest
import torch

from tests.attention.batches import make_batch, reference

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# (cached prefix, new tokens) per sequence: a fresh prefill, decodes over short and
# long contexts (empty splits for the short ones), an extend over a prefix in two
# query tiles, a 1-token-context decode, a block-aligned chunk
MIXED = [(0, 5), (20, 1), (150, 1), (37, 70), (3, 1), (16, 16)]
# the same kinds of rows, fewer queries: for the configurations with many heads
MIXED_SHORT = [(0, 5), (20, 1), (150, 1), (40, 20)]


def skip_unless_launchable(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    from tokenmill.attention.triton import backend

    cuda = device.type == "cuda"
    dtypes = backend.CUDA_DTYPES if cuda else backend.INTERPRETER_DTYPES
    dims = backend.CUDA_HEAD_DIMS if cuda else backend.INTERPRETER_HEAD_DIMS
    if dtype not in dtypes or head_dim not in dims:
        pytest.skip(f"{dtype}, head_dim {head_dim} is not launched on {device.type}")


def run(batch, num_splits: int | None, dtype: torch.dtype, scale: float) -> torch.Tensor:
    from tokenmill.attention.triton import TritonBackend

    backend = TritonBackend(batch.q.device, dtype, num_splits=num_splits)
    backend.store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta)
    batch.meta.plan = backend.plan(batch.meta)
    return backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache,
                           batch.meta, scale)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "splits", "dtype"), [
    (9, 3, 64, 16, 1, torch.float32),     # SmolLM2
    (9, 3, 64, 16, 4, torch.float16),
    (9, 3, 64, 16, 4, torch.bfloat16),    # bf16: on a GPU only
    (32, 8, 128, 16, 1, torch.float16),   # Llama-3-8B
    (32, 8, 128, 16, 1, torch.bfloat16),
    (32, 8, 128, 32, 4, torch.float32),
    (8, 1, 64, 64, 3, torch.float32),     # MQA
    (8, 1, 128, 16, 1, torch.float16),
    (4, 2, 16, 16, 2, torch.float32),     # the tiny test model
    (40, 2, 32, 16, 3, torch.float32),    # group 20: two programs per KV head
])
def test_mixed_batch_matches_reference(kernel_device, heads, kv_heads, head_dim, block_size,
                                       splits, dtype):
    skip_unless_launchable(kernel_device, dtype, head_dim)
    seqs = MIXED if heads * head_dim <= 1024 else MIXED_SHORT  # the interpreter is slow
    batch = make_batch(seqs, heads, kv_heads, head_dim, block_size, dtype,
                       device=kernel_device)
    scale = head_dim ** -0.5
    out = run(batch, splits, dtype, scale)
    assert (batch.meta.plan.num_splits > 1) == (splits > 1)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.float().cpu(), reference(batch, scale), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("seqs", [
    [(40, 1), (0, 1), (200, 1)],   # decode only
    [(0, 33), (50, 14)],           # prefill only: one fresh, one over a cached prefix
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_only_and_prefill_only_steps(kernel_device, seqs, dtype):
    skip_unless_launchable(kernel_device, dtype, 64)
    batch = make_batch(seqs, 9, 3, 64, 16, dtype, seed=1, device=kernel_device)
    out = run(batch, None, dtype, 0.125)
    torch.testing.assert_close(out.float().cpu(), reference(batch, 0.125), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize(("seqs", "splits", "planned"), [
    ([(300, 1), (5, 1), (130, 1)], 5, 5),
    # 18 one-tile splits: the reduce combines the long row's in two chunks of 16 and
    # the short row's one split alone
    ([(5, 1), (1100, 1)], 20, 18),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_k_agrees_with_one_split(kernel_device, dtype, seqs, splits, planned):
    skip_unless_launchable(kernel_device, dtype, 64)
    one = run(make_batch(seqs, 8, 2, 64, 16, dtype, seed=2, device=kernel_device), 1, dtype,
              0.125)
    batch = make_batch(seqs, 8, 2, 64, 16, dtype, seed=2, device=kernel_device)
    many = run(batch, splits, dtype, 0.125)
    assert batch.meta.plan.num_splits == planned
    torch.testing.assert_close(many.float(), one.float(), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_only_its_slots(kernel_device, dtype):
    from tokenmill.attention.triton import TritonBackend

    skip_unless_launchable(kernel_device, dtype, 64)
    dev = kernel_device
    batch = make_batch([(0, 3), (5, 2)], 4, 2, 64, 16, dtype, seed=3, device=dev)
    before = batch.k_cache.clone()
    # a padding token (slot -1) is not stored
    k = torch.cat([batch.k, torch.ones(1, 2, 64, dtype=dtype, device=dev)])
    v = torch.cat([batch.v, torch.ones(1, 2, 64, dtype=dtype, device=dev)])
    batch.meta.slot_mapping = torch.cat([batch.meta.slot_mapping,
                                         torch.tensor([-1], device=dev)])
    TritonBackend(dev, dtype).store_kv(k, v, batch.k_cache, batch.v_cache, batch.meta)
    flat_k = batch.k_cache.view(-1, 2, 64)
    slots = batch.meta.slot_mapping[:-1]
    torch.testing.assert_close(flat_k[slots], batch.k, atol=0, rtol=0)
    torch.testing.assert_close(batch.v_cache.view(-1, 2, 64)[slots], batch.v, atol=0, rtol=0)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=dev)
    untouched[slots] = False
    torch.testing.assert_close(flat_k[untouched], before.view(-1, 2, 64)[untouched],
                               equal_nan=True, atol=0, rtol=0)
