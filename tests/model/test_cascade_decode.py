"""Shared-prefix (cascade) decode in one native call (tm_cascade_decode_bf16): the
blocks every sequence's table starts with are read once for the whole batch, each
sequence's own blocks after them, and the two parts merged, matching the torch
reference backend and the torch-merge path it replaces."""

from __future__ import annotations

import random

import pytest
import torch

from tests.model.test_attention_fast import mixed_step
from tests.model.test_native_kernels import assert_bf16_close
from tokenmill.attention import cpu
from tokenmill.attention.cpu import _DecodePlan, paged_attention_fast, store_kv_cache
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.torch_ref import kv_cache_shape, paged_attention_reference
from tokenmill.kernels import paged_decode as native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernel not built here")


def decode_batch(own_lens, shared, block_size, heads=9, kv_heads=3, head_dim=64, seed=0,
                 shared_by=None):
    """A decode step: every table starts with the same `shared` blocks (the first
    `shared_by` tables only, when given; the others have their own blocks there), then
    `own_lens[b]` tokens in blocks of its own, all blocks shuffled in the pool."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    own_blocks = [-(-n // block_size) for n in own_lens]
    num_blocks = shared * (1 + len(own_lens)) + sum(own_blocks) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    common = [free.pop() for _ in range(shared)]
    tables = []
    for b, n in enumerate(own_blocks):
        mine = shared_by is not None and b >= shared_by
        prefix = [free.pop() for _ in range(shared)] if mine else common
        tables.append(prefix + [free.pop() for _ in range(n)])
    seq_lens = [shared * block_size + n for n in own_lens]
    shape = kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    num_seqs = len(own_lens)
    q = torch.randn(num_seqs, heads, head_dim, generator=gen).bfloat16()
    k = torch.randn(num_seqs, kv_heads, head_dim, generator=gen).bfloat16()
    v = torch.randn(num_seqs, kv_heads, head_dim, generator=gen).bfloat16()
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size
             for t, n in zip(tables, seq_lens)]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        block_size=block_size, max_query_len=1, max_seq_len=max(seq_lens),
        query_lens_list=[1] * num_seqs, seq_lens_list=seq_lens)
    store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta


@pytest.fixture(autouse=True)
def cascade_at_any_size(monkeypatch):
    """The kernel at the tests' small sizes (the thresholds are measured at larger ones;
    test_the_kernel_takes_batches_that_fill_its_lanes holds them)."""
    monkeypatch.setattr(cpu, "MIN_CASCADE_BLOCKS", 1)
    monkeypatch.setattr(cpu, "MIN_CASCADE_SEQS", 1)
    monkeypatch.setattr(cpu, "PROMPT_TILED", False)  # prompt chunks: the cascade call


def no_torch_merge(*args, **kwargs):
    raise AssertionError("the shared prefix went through the torch matmul, not the kernel")


@pytest.mark.parametrize("own_lens,shared,block_size,heads,kv_heads,head_dim", [
    ([64 + 4 * i for i in range(16)], 64, 16, 9, 3, 64),  # W5: 1,024 shared, ragged own
    ([1, 3, 9, 4, 11], 7, 5, 9, 3, 64),  # odd block size, a 1-token own part
    ([2, 5, 1], 9, 3, 6, 2, 16),  # head_dim 16: the plain C loops
    ([17] * 40, 10, 16, 9, 3, 64),  # 120 queries per kv head: several lane groups
    ([1, 16], 4, 16, 8, 2, 128),  # Llama-3-8B's grouping
    (list(range(1, 8)), 37, 1, 10, 1, 64),  # block size 1, one kv head
    ([3, 3, 3, 3], 5, 7, 4, 4, 32),  # no grouping
    ([5] * 33, 40, 2, 16, 2, 128),  # 8 x 128 per kv head
])
@pytest.mark.parametrize("threads", [1, 2])
def test_cascade_decode_matches_the_reference(own_lens, shared, block_size, heads, kv_heads,
                                              head_dim, threads, monkeypatch):
    q, k, v, k_cache, v_cache, meta = decode_batch(own_lens, shared, block_size, heads,
                                                   kv_heads, head_dim)
    plan = _DecodePlan(meta.block_tables, meta.seq_lens_list, k_cache)
    assert plan.native and plan.shared == shared
    scale = head_dim ** -0.5
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    monkeypatch.setattr(cpu, "_prefix_scores", no_torch_merge)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fast = paged_attention_fast(q, k, v, k_cache, v_cache, meta, scale)
    finally:
        torch.set_num_threads(before)
    assert fast.dtype == torch.bfloat16 and fast.shape == q.shape
    assert_bf16_close(fast.float(), ref)


def test_cascade_agrees_with_the_torch_merge_it_replaces(monkeypatch):
    q, k, v, k_cache, v_cache, meta = decode_batch([30, 7, 19, 50], 6, 16)
    fast = paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.125).float()
    monkeypatch.setattr(cpu, "CASCADE_NATIVE", False)
    meta.plan = None
    torch_merge = paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.125).float()
    assert_bf16_close(fast, torch_merge)


def test_only_the_blocks_all_sequences_share_are_attended_once():
    # three tables share 6 blocks, the fourth only the first 4 of them: 4 are shared
    q, k, v, k_cache, v_cache, meta = decode_batch([9, 12, 3, 20], 6, 4, seed=1)
    tables = meta.block_tables.clone()
    tables[3, 4:6] = torch.tensor([k_cache.shape[1] - 1, k_cache.shape[1] - 2])
    meta.block_tables = tables
    plan = _DecodePlan(tables, meta.seq_lens_list, k_cache)
    assert plan.shared == 4
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    assert_bf16_close(paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.125).float(), ref)


def test_n_siblings_share_the_prompt_blocks_and_diverge_after():
    # n > 1: one prompt of 5 full blocks, four samples each writing their own tokens
    q, k, v, k_cache, v_cache, meta = decode_batch([1, 2, 2, 3], 5, 16, seed=2)
    plan = _DecodePlan(meta.block_tables, meta.seq_lens_list, k_cache)
    assert plan.shared == 5
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    assert_bf16_close(paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.125).float(), ref)


def test_slots_past_each_sequences_end_are_never_read():
    q, k, v, k_cache, v_cache, meta = decode_batch([5, 17, 9], 4, 4, seed=3)
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    written = torch.zeros(k_cache.shape[1:3], dtype=torch.bool)
    for table, n in zip(meta.block_tables.tolist(), meta.seq_lens_list):
        for p in range(n):
            written[table[p // 4], p % 4] = True
    k_cache[:, ~written] = float("nan")
    v_cache[:, ~written] = float("nan")
    fast = paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.125).float()
    assert_bf16_close(fast, ref)


def test_the_kernel_declines_tables_that_differ_in_the_shared_blocks():
    q, _, _, k_cache, v_cache, meta = decode_batch([4, 4], 5, 4, shared_by=1)
    tables = meta.block_tables.contiguous()
    lens = torch.tensor([4, 4], dtype=torch.int32)
    assert native.cascade_decode(q, k_cache, v_cache, tables, 5, lens, 4, 0.125,
                                 torch.empty) is None
    bad_len = torch.tensor([4, 5], dtype=torch.int32)  # past max_len
    same = tables.clone()
    same[1, :5] = same[0, :5]
    assert native.cascade_decode(q, k_cache, v_cache, same, 5, bad_len, 4, 0.125,
                                 torch.empty) is None
    assert native.cascade_decode(q, k_cache, v_cache, same, 5, lens, 4, 0.125,
                                 torch.empty) is not None


def test_switched_off_the_torch_merge_runs(monkeypatch):
    monkeypatch.setattr(cpu, "CASCADE_NATIVE", False)
    monkeypatch.setattr(native, "cascade_decode", no_torch_merge)
    q, k, v, k_cache, v_cache, meta = decode_batch([8, 3, 12], 5, 4, seed=4)
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    assert_bf16_close(paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.125).float(), ref)


def test_the_kernel_takes_batches_that_fill_its_lanes(monkeypatch):
    monkeypatch.undo()  # the measured thresholds
    _, _, _, k_cache, _, meta = decode_batch([70] * 16, 64, 16)  # W5: 1,024 shared tokens
    assert _DecodePlan(meta.block_tables, meta.seq_lens_list, k_cache).shared == 64
    # two sequences fill 6 of 16 query lanes: each reads its whole table in paged_decode
    _, _, _, k_cache, _, meta = decode_batch([70] * 2, 64, 16)
    assert _DecodePlan(meta.block_tables, meta.seq_lens_list, k_cache).shared == 0
    # 16 sequences, a 3-block prompt: too short to pay for the merge
    _, _, _, k_cache, _, meta = decode_batch([70] * 16, 3, 16)
    assert _DecodePlan(meta.block_tables, meta.seq_lens_list, k_cache).shared == 0


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (6, 2, 16)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_prompt_chunks_over_a_cached_prefix_go_through_the_kernel_and_match(
        heads, kv_heads, head_dim, contiguous, monkeypatch):
    # a 12-token chunk over 38 cached tokens (9 full blocks of 4, 2 tokens of a partial
    # one), a decode, a whole prompt, a 40-token chunk over 1 cached token (no full
    # block: SDPA), a 20-token chunk over exactly 32 cached tokens (8 blocks)
    monkeypatch.undo()  # the measured thresholds: >= 8 cached blocks, >= 8 new tokens
    monkeypatch.setattr(cpu, "PROMPT_TILED", False)  # what the tiled kernel stands before
    query_lens, seq_lens = [12, 1, 9, 40, 20], [50, 30, 9, 41, 52]
    q, k, v, k_cache, v_cache, meta = mixed_step(query_lens, seq_lens, torch.bfloat16,
                                                 contiguous, heads=heads, kv_heads=kv_heads,
                                                 head_dim=head_dim)
    calls = []
    kernel = native.cascade_decode

    def counted(q, *args):
        calls.append(q.shape[0])
        return kernel(q, *args)

    monkeypatch.setattr(native, "cascade_decode", counted)
    scale = head_dim ** -0.5
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    fast = paged_attention_fast(q, k, v, k_cache, v_cache, meta, scale).float()
    assert sorted(calls) == [12, 20]  # the two chunks with full cached blocks
    assert_bf16_close(fast, ref)


def test_a_long_prompt_chunk_keeps_sdpa(monkeypatch):
    monkeypatch.setattr(cpu, "MAX_EXTEND_QUERIES", 8)
    monkeypatch.setattr(native, "cascade_decode", no_torch_merge)
    q, k, v, k_cache, v_cache, meta = mixed_step([12], [50], torch.bfloat16, False,
                                                 heads=9, kv_heads=3, head_dim=64)
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    assert_bf16_close(paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.125).float(), ref)
