"""Prompt chunks through the tiled kernel (cpu._prompt_tiled, tm_prompt_attend_bf16):
16-query tiles with the queries in vector lanes against every cached key up to their
last, masked after the diagonal. Whole prompts, several in a step, chunks over a cached
prefix ending in a part-full block, a lone decode row: within bf16 rounding of the torch
reference backend, and none of the paths it stands before is called."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_attention_fast import mixed_step
from tests.model.test_native_kernels import assert_bf16_close
from tokenmill.attention import cpu
from tokenmill.attention.cpu import paged_attention_fast
from tokenmill.attention.torch_ref import paged_attention_reference
from tokenmill.kernels import paged_decode as native

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernel not built here")


def refuse(name):
    def call(*args, **kwargs):
        raise AssertionError(f"a prompt chunk took {name}")
    return call


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 32), (6, 2, 16)])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([37], [37]),  # a whole prompt: two full tiles and a part-full one
    ([5, 64, 2], [5, 64, 2]),  # three prompts in one step
    ([12, 9, 40, 20], [50, 9, 41, 52]),  # chunks over cached prefixes and a prompt
    ([1, 30, 1], [20, 30, 9]),  # decode rows (batched) beside a prompt
    ([1, 30], [20, 30]),  # one decode row beside a prompt: a one-query chunk
])
def test_prompt_tiles_match_the_reference(heads, kv_heads, head_dim, contiguous, query_lens,
                                          seq_lens, monkeypatch):
    q, k, v, k_cache, v_cache, meta = mixed_step(query_lens, seq_lens, torch.bfloat16,
                                                 contiguous, heads=heads, kv_heads=kv_heads,
                                                 head_dim=head_dim)
    scale = head_dim ** -0.5
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    for name in ("_attend", "_prompt_native", "_extend_native"):
        monkeypatch.setattr(cpu, name, refuse(name))
    out = paged_attention_fast(q, k, v, k_cache, v_cache, meta, scale)
    assert out.dtype == torch.bfloat16
    assert_bf16_close(out.float(), ref)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 32)])
def test_peaked_scores_whose_weights_underflow_match_the_reference(heads, kv_heads,
                                                                   head_dim, monkeypatch):
    """Scores spread over hundreds (q x 4, scale 1): most softmax weights underflow to 0
    and a few keys carry each row, which a wrong exponential or maximum would miss."""
    q, k, v, k_cache, v_cache, meta = mixed_step([70, 33], [70, 90], torch.bfloat16, False,
                                                 heads=heads, kv_heads=kv_heads,
                                                 head_dim=head_dim)
    q = q * 4
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 1.0)
    for name in ("_attend", "_prompt_native", "_extend_native"):
        monkeypatch.setattr(cpu, name, refuse(name))
    assert_bf16_close(paged_attention_fast(q, k, v, k_cache, v_cache, meta, 1.0).float(), ref)


@pytest.mark.parametrize("num_q,seq_len", [(200, 200), (64, 300)])
def test_tiled_outputs_are_the_row_kernels_bit_for_bit_but_rarely(num_q, seq_len):
    """The tiled kernel sums q . k in another order and exponentiates with its own expf
    (within 1.2e-7 of libmvec's): its bf16 outputs equal the row-by-row kernel's in all
    but a few elements (99.9% here). An exponential off by 1e-4 leaves ~90% equal."""
    gen = torch.Generator().manual_seed(0)
    blocks = -(-seq_len // 16)
    k_cache = torch.randn(3, 2 * blocks + 8, 16, 64, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(torch.bfloat16)
    table = torch.randperm(2 * blocks + 8, generator=gen)[:blocks].tolist()
    q = torch.randn(num_q, 9, 64, generator=gen).to(torch.bfloat16)
    rows = cpu._prompt_native(q, k_cache, v_cache, table, seq_len, 0.125)
    tiled = cpu._prompt_tiled(q, k_cache, v_cache, torch.tensor(table, dtype=torch.int32),
                              seq_len, 0.125)
    assert tiled is not None and rows is not None
    assert (tiled == rows).float().mean().item() >= 0.99


def test_past_its_key_limit_and_off_the_paths_before_it_run(monkeypatch):
    q, k, v, k_cache, v_cache, meta = mixed_step([40], [40], torch.bfloat16, False,
                                                 heads=9, kv_heads=3, head_dim=64)
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    calls = []
    real = cpu._prompt_native
    monkeypatch.setattr(cpu, "_prompt_native", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(cpu, "MAX_TILED_KEYS", 32)
    assert_bf16_close(paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.125).float(), ref)
    assert calls  # 40 keys > 32: the row-by-row kernel
    calls.clear()
    monkeypatch.setattr(cpu, "MAX_TILED_KEYS", 16384)
    monkeypatch.setattr(cpu, "PROMPT_TILED", False)  # TOKENMILL_PROMPT_TILED=0
    assert_bf16_close(paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.125).float(), ref)
    assert calls


def test_the_kernel_declines_what_it_cannot_read():
    kc = torch.randn(3, 8, 16, 64).to(torch.bfloat16)
    q = torch.randn(20, 9, 64).to(torch.bfloat16)
    ws = lambda n: torch.empty(n, dtype=torch.float32)
    ok = torch.tensor([3, 1], dtype=torch.int32)
    assert native.prompt_attend(q, kc, kc, ok, 20, 0.125, ws) is not None
    # a block outside the pool, more queries than keys, a table too short for the keys
    assert native.prompt_attend(q, kc, kc, torch.tensor([3, 8], dtype=torch.int32), 20,
                                0.125, ws) is None
    assert native.prompt_attend(q, kc, kc, ok, 19, 0.125, ws) is None
    assert native.prompt_attend(q, kc, kc, ok[:1], 20, 0.125, ws) is None
    assert native.prompt_attend(q.float(), kc, kc, ok, 20, 0.125, ws) is None  # not bf16
