"""The fast CPU attention path computes what the plain reference computes."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.attention import cpu as attention_fast
from tokenmill.attention.cpu import _DecodePlan, paged_attention_fast, store_kv_cache
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.torch_ref import kv_cache_shape, paged_attention_reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 4


@pytest.fixture(params=["native", "torch"], autouse=True)
def decode_path(request, monkeypatch):
    """Every test runs with bf16 decode rows on the native kernel (where it builds)
    and on the plain-torch gather path."""
    if request.param == "torch":
        monkeypatch.setattr(attention_fast, "use_native", lambda k_cache: False)
    elif not attention_fast.native.available():
        pytest.skip("native kernel not built here (no C compiler?)")
    return request.param


def mixed_step(query_lens, seq_lens, dtype, contiguous, seed=0, shared=0, heads=HEADS,
               kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    """shared: every table starts with the same `shared` blocks (a cached prompt)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    free = list(range(num_blocks))
    if not contiguous:
        rng.shuffle(free)
    common = [free.pop(0) for _ in range(shared)]
    tables = []
    for n in seq_lens:
        need = -(-n // BLOCK)
        tables.append(common + [free.pop(0) for _ in range(need - shared)])
    shape = kv_cache_shape(num_blocks, BLOCK, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    total = sum(query_lens)
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    slots, starts = [], [0]
    for table, ql, sl in zip(tables, query_lens, seq_lens):
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(sl - ql, sl)]
        starts.append(starts[-1] + ql)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        block_size=BLOCK, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_list=list(query_lens), seq_lens_list=list(seq_lens))
    store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1], [13]),  # one decode
    ([1, 1, 1, 1], [5, 17, 9, 30]),  # decode-only batch
    ([11], [11]),  # a whole prompt
    ([7], [19]),  # a prompt chunk after a cached prefix
    ([1, 9, 1, 4, 1, 1], [12, 9, 26, 10, 3, 8]),  # mixed prefill, chunk and decodes
])
def test_fast_path_matches_reference(dtype, contiguous, query_lens, seq_lens):
    q, k, v, k_cache, v_cache, meta = mixed_step(query_lens, seq_lens, dtype, contiguous)
    scale = HEAD_DIM ** -0.5
    ref = paged_attention_reference(q, k_cache, v_cache, meta, scale).float()
    fast = paged_attention_fast(q, k, v, k_cache, v_cache, meta, scale).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 1, 1, 1], [23, 30, 21, 40]),  # decodes after a 20-token shared prompt
    ([1, 6, 1, 1], [29, 26, 21, 33]),  # ... with a prompt chunk of a sibling in the step
])
def test_decodes_sharing_prefix_blocks_attend_to_them_once_and_match_reference(
        dtype, contiguous, query_lens, seq_lens, monkeypatch):
    shared = 5  # blocks of 4: 20 tokens, >= MIN_SHARED_BLOCKS
    monkeypatch.setattr(attention_fast, "MIN_CASCADE_BLOCKS", 1)  # the kernel at this size
    monkeypatch.setattr(attention_fast, "MIN_CASCADE_SEQS", 1)
    q, k, v, k_cache, v_cache, meta = mixed_step(query_lens, seq_lens, dtype, contiguous,
                                                 shared=shared)
    decodes = [b for b, n in enumerate(query_lens) if n == 1]
    plan = _DecodePlan(meta.block_tables[decodes], [seq_lens[b] for b in decodes], k_cache)
    assert plan.shared == shared  # the shared-prefix path is the one under test
    scale = HEAD_DIM ** -0.5
    ref = paged_attention_reference(q, k_cache, v_cache, meta, scale).float()
    fast = paged_attention_fast(q, k, v, k_cache, v_cache, meta, scale).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)


def test_shared_prefix_stops_where_tables_differ_and_keeps_a_token_of_each_own():
    _, _, _, k_cache, _, meta = mixed_step([1, 1], [21, 30], torch.float32, True, shared=5)
    assert _DecodePlan(meta.block_tables, [21, 30], k_cache).shared == 5
    # 20 tokens in 5 shared blocks and a sequence of exactly 20: it keeps its last block
    assert _DecodePlan(meta.block_tables, [20, 30], k_cache).shared == 4
    _, _, _, k_cache, _, meta = mixed_step([1, 1], [21, 30], torch.float32, True, shared=3)
    assert _DecodePlan(meta.block_tables, [21, 30], k_cache).shared == 0  # below the minimum


def test_batched_decode_runs_outside_inference_mode_after_running_inside_it(monkeypatch):
    # the engine runs under inference_mode; the scratch it leaves must not break callers
    # that do not (a tensor created in inference mode cannot be written outside it)
    monkeypatch.setattr(attention_fast, "_workspace", attention_fast._Workspace())
    big = ([1, 1, 1, 1], [45, 57, 49, 60])
    with torch.inference_mode():  # the scratch is first allocated in here
        inside = mixed_step(*big, torch.float32, True)
        paged_attention_fast(*inside, HEAD_DIM ** -0.5)
    q, k, v, k_cache, v_cache, meta = mixed_step(*big, torch.float32, True)
    fast = paged_attention_fast(q, k, v, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    ref = paged_attention_reference(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_reference_path_ignores_nan_in_padding_slots():
    """The reference path is safe on any pool; the fast path relies on the model
    runner zeroing blocks on first use (tests/engine/test_model_runner.py)."""
    q, _, _, k_cache, v_cache, meta = mixed_step([1, 1, 1], [5, 17, 9], torch.float32, False)
    written = torch.zeros(k_cache.shape[1:3], dtype=torch.bool)  # (blocks, slots)
    for table, n in zip(meta.block_tables.tolist(), meta.seq_lens_list):
        for p in range(n):
            written[table[p // BLOCK], p % BLOCK] = True
    k_cache[:, ~written] = float("nan")
    v_cache[:, ~written] = float("nan")
    out = paged_attention_reference(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    assert torch.isfinite(out).all()
