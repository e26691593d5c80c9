"""Rotary fused with the KV store (tokenmill/attention/triton/rotary_store.py) against
the two kernels it replaces, rotary then the store: the same rotated q and k in place,
the same pool contents (NaN-filled pools keep NaN wherever nothing was stored, padding
rows store nothing). Under the interpreter in fp32 and fp16; compiled where CUDA is."""

from __future__ import annotations

import pytest
import torch

from tokenmill.models.layers import RotaryEmbedding


def _dtypes(device: torch.device) -> list[torch.dtype]:
    return [torch.float32, torch.float16] + ([torch.bfloat16] if device.type == "cuda" else [])


def _case(device, dtype, tokens, heads, kv_heads, d, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(device, dtype)
    positions = torch.randint(0, 300, (tokens,), generator=g).to(device)
    num_blocks, block_size = 4, 16
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    if tokens > 1:
        slots[1] = -1  # a padding row: nothing stored
    pool = torch.full((num_blocks, block_size, kv_heads, d), float("nan"), dtype=dtype)
    return qkv, positions, slots.to(device), pool.to(device), pool.clone().to(device)


def _views(qkv, heads, kv_heads, d):
    qk = qkv[:, :(heads + kv_heads) * d].unflatten(-1, (heads + kv_heads, d))
    v = qkv[:, (heads + kv_heads) * d:].unflatten(-1, (kv_heads, d))
    return qk, v


@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "d"),
                         [(1, 32, 8, 128), (5, 4, 1, 256), (3, 6, 2, 16), (7, 2, 2, 64)])
def test_one_kernel_gives_what_rotary_then_the_store_give(kernel_device, tokens, heads,
                                                          kv_heads, d):
    from tokenmill.attention.triton import rotary_store, store_kv
    from tokenmill.kernels import triton_layer_ops

    rot = RotaryEmbedding(d, 512, 10000.0).to(kernel_device)
    for dtype in _dtypes(kernel_device):
        qkv, positions, slots, k_want, v_want = _case(kernel_device, dtype, tokens, heads,
                                                      kv_heads, d, tokens + d)
        before = qkv.clone()
        qk, v = _views(qkv, heads, kv_heads, d)
        assert triton_layer_ops.rotary_(qk, positions, rot.cos_cache, rot.sin_cache)
        store_kv.store_kv(qk[:, heads:], v, k_want, v_want, slots)
        got = before.clone()
        qk, v = _views(got, heads, kv_heads, d)
        k_got, v_got = (torch.full_like(k_want, float("nan")) for _ in range(2))
        assert rotary_store.rotary_store_kv(qk, v, heads, positions, rot.cos_cache,
                                            rot.sin_cache, k_got, v_got, slots)
        assert torch.equal(got, qkv)  # q and k rotated in place alike, v untouched
        torch.testing.assert_close(k_got, k_want, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v_got, v_want, rtol=0, atol=0, equal_nan=True)
        stored = k_got.flatten(0, 1).isnan().all(-1).all(-1).logical_not()
        assert stored.sum() == tokens - (tokens > 1)  # one slot a row, none for padding


def test_what_it_does_not_take_is_left_untouched(kernel_device):
    """A head_dim not a power of two, a head count v does not match, int32 positions:
    False, and nothing written (the caller then rotates and stores as before)."""
    from tokenmill.attention.triton import rotary_store

    for d, num_heads, pos_dtype in ((48, 2, torch.int64), (16, 1, torch.int64),
                                    (16, 2, torch.int32)):
        rot = RotaryEmbedding(d, 64, 10000.0).to(kernel_device)
        qkv, positions, slots, k, v_pool = _case(kernel_device, torch.float32, 2, 2, 1, d, 0)
        qk, v = _views(qkv, 2, 1, d)
        before = qkv.clone()
        assert not rotary_store.rotary_store_kv(qk, v, num_heads, positions.to(pos_dtype),
                                                rot.cos_cache, rot.sin_cache, k, v_pool,
                                                slots)
        assert torch.equal(qkv, before) and k.isnan().all() and v_pool.isnan().all()
