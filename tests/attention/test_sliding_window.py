"""The sliding-window mask (key k visible to query q iff 0 <= q - k < W) in every
attention backend, against a dense brute-force reference: torch, cpu (bf16, the
native-kernel build, and fp32) and triton (interpreter, or compiled on a GPU), over
mixed batches of decodes and prefill chunks over cached prefixes, with split-K, and
at Gemma 3 270M's head shape (4 query heads, 1 KV head, head_dim 256)."""

from __future__ import annotations

import pytest
import torch

from tests.attention.batches import PagedBatch, make_batch

# (cached prefix, new tokens): decodes inside and far past the window, a fresh prompt
# longer than it, a chunk over a prefix straddling it, a decode right at its edge
SEQS = [(0, 40), (20, 1), (150, 1), (37, 30), (23, 1), (3, 1)]
WINDOW = 24


def dense_reference(batch: PagedBatch, scale: float, window: int) -> torch.Tensor:
    """Each sequence's keys laid out in order, every (query, key) pair scored, masked."""
    meta = batch.meta
    kv_heads, d = batch.k_cache.shape[2], batch.k_cache.shape[3]
    k_flat = batch.k_cache.float().cpu().reshape(-1, kv_heads, d)
    v_flat = batch.v_cache.float().cpu().reshape(-1, kv_heads, d)
    q = batch.q.float().cpu()
    tables = meta.block_tables.cpu().tolist()
    out, start = [], 0
    for b, (qlen, slen) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        slots = [tables[b][p // meta.block_size] * meta.block_size + p % meta.block_size
                 for p in range(slen)]
        k, v = k_flat[slots], v_flat[slots]  # (L, kv, d)
        group = q.shape[1] // kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + qlen], k) * scale
        q_pos = torch.arange(slen - qlen, slen)[:, None]
        k_pos = torch.arange(slen)[None, :]
        visible = (q_pos >= k_pos) & (q_pos - k_pos < window)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += qlen
    return torch.cat(out)


def _head_major(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The triton layout (blocks, block_size, kv, d) -> the torch/cpu one (kv, blocks, bs, d)."""
    return cache.permute(2, 0, 1, 3).contiguous().to(dtype)


def _store_then_forward(backend, batch: PagedBatch, k_cache, v_cache, scale, window):
    backend.store_kv(batch.k, batch.v, k_cache, v_cache, batch.meta)
    batch.meta.plan = backend.plan(batch.meta)
    return backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, scale,
                           sliding_window=window)


@pytest.mark.parametrize(("backend_name", "dtype", "tol"), [
    ("torch", torch.float32, 1e-5),
    ("cpu", torch.float32, 1e-5),
    ("cpu", torch.bfloat16, 3e-2),
])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 1, 256), (9, 3, 64)])
def test_torch_and_cpu_backends_mask_the_window(backend_name, dtype, tol, heads, kv_heads,
                                                head_dim):
    from tokenmill.attention import get_backend

    batch = make_batch(SEQS, heads, kv_heads, head_dim, 16, torch.float32, seed=4)
    k_cache = _head_major(batch.k_cache.nan_to_num(0.0), dtype)
    v_cache = _head_major(batch.v_cache.nan_to_num(0.0), dtype)
    for name in ("q", "k", "v"):
        setattr(batch, name, getattr(batch, name).to(dtype))
    backend = get_backend(backend_name, torch.device("cpu"), dtype)
    backend.bind_pool([(k_cache, v_cache)])
    scale = head_dim ** -0.5
    out = _store_then_forward(backend, batch, k_cache, v_cache, scale, WINDOW)
    # the reference reads the same stored caches, back in the triton layout
    batch.k_cache, batch.v_cache = k_cache.permute(1, 2, 0, 3), v_cache.permute(1, 2, 0, 3)
    expected = dense_reference(batch, scale, WINDOW)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=0)
    unwindowed = dense_reference(batch, scale, 10**9)
    assert (unwindowed - expected).abs().max() > 0.05  # the window did mask something


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "splits", "dtype"), [
    (4, 1, 256, 1, torch.float32),   # Gemma 3 270M
    (4, 1, 256, 3, torch.float16),   # split-K: the splits before the window are empty
    (9, 3, 64, 5, torch.float32),
])
def test_triton_kernels_mask_the_window(kernel_device, heads, kv_heads, head_dim, splits,
                                        dtype):
    from tests.attention.test_triton_kernels import skip_unless_launchable
    from tokenmill.attention.triton import TritonBackend

    skip_unless_launchable(kernel_device, dtype, head_dim)
    batch = make_batch(SEQS, heads, kv_heads, head_dim, 16, dtype, seed=4,
                       device=kernel_device)
    backend = TritonBackend(kernel_device, dtype, num_splits=splits)
    scale = head_dim ** -0.5
    out = _store_then_forward(backend, batch, batch.k_cache, batch.v_cache, scale, WINDOW)
    assert not out.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(out.float().cpu(), dense_reference(batch, scale, WINDOW),
                               atol=tol, rtol=0)


def test_an_8bit_kv_cache_masks_the_window():
    """--kv-cache-dtype int8: the blocks the step reads dequantized, then the mask."""
    from tokenmill.attention import get_backend
    from tokenmill.attention.kv_quant import kv_format
    from tokenmill.attention.quantized import QuantizedKVBackend, QuantizedPool

    batch = make_batch(SEQS, 4, 1, 256, 16, torch.float32, seed=5)
    fmt = kv_format("int8")
    backend = QuantizedKVBackend(get_backend("cpu", torch.device("cpu"), torch.bfloat16), fmt)
    num_blocks = batch.k_cache.shape[0]
    shape = backend.kv_cache_shape(num_blocks, 16, 1, 256)
    k_pool = QuantizedPool.allocate(fmt, shape, torch.device("cpu"), torch.zeros)
    v_pool = QuantizedPool.allocate(fmt, shape, torch.device("cpu"), torch.zeros)
    # the cached prefixes first (every slot the reference reads), then this step's tokens
    flat_k = batch.k_cache.view(-1, 1, 256)
    written = ~flat_k[:, 0, 0].isnan()
    slots = written.nonzero().flatten()
    from tokenmill.attention.metadata import AttentionMetadata

    prefix_meta = AttentionMetadata(slots, batch.meta.query_start_loc, batch.meta.seq_lens,
                                    batch.meta.block_tables, 16, 1, 1, [], [])
    backend.store_kv(flat_k[slots].bfloat16(), batch.v_cache.view(-1, 1, 256)[slots].bfloat16(),
                     k_pool, v_pool, prefix_meta)
    scale = 256 ** -0.5
    q, k, v = batch.q.bfloat16(), batch.k.bfloat16(), batch.v.bfloat16()
    backend.store_kv(k, v, k_pool, v_pool, batch.meta)
    batch.meta.plan = backend.plan(batch.meta)
    out = backend.forward(q, k, v, k_pool, v_pool, batch.meta, scale, sliding_window=WINDOW)
    flat_k[batch.meta.slot_mapping] = batch.k.view(-1, 1, 256)
    batch.v_cache.view(-1, 1, 256)[batch.meta.slot_mapping] = batch.v.view(-1, 1, 256)
    expected = dense_reference(batch, scale, WINDOW)
    torch.testing.assert_close(out.float(), expected, atol=0.1, rtol=0)
    assert (dense_reference(batch, scale, 10**9) - expected).abs().max() > 0.3
