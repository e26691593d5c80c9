"""The native paged-decode kernel: built where a compiler exists, equal to the
reference attention at real model shapes, and never required."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.model.test_attention_fast import mixed_step
from tokenmill.kernels import build
from tokenmill.kernels import paged_decode as native
from tokenmill.models import attention_fast
from tokenmill.models.attention import paged_attention_reference
from tokenmill.models.attention_fast import _DecodePlan, paged_attention_fast


def assert_bf16_close(fast: torch.Tensor, ref: torch.Tensor) -> None:
    """Within bf16 rounding of the output and of the softmax weights, elementwise and
    on average (a wrong block or merge weight moves the mean far more)."""
    torch.testing.assert_close(fast, ref, atol=2e-2, rtol=2e-2)
    assert (fast - ref).abs().mean() < 1.5e-3


needs_kernel = pytest.mark.skipif(not native.available(), reason="native kernel not built here")


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """Builds into an empty cache and forgets what earlier tests loaded."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    build.load.cache_clear()
    yield tmp_path
    build.load.cache_clear()


def test_kernel_builds_where_a_compiler_exists():
    # a broken C file must fail the suite, not silently fall back to the torch path
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    assert native.available()


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64),  # SmolLM2-135M: the AVX512-BF16 path where the CPU has it
    (8, 2, 128),  # Llama-3-8B's grouping and head size
    (4, 4, 32),  # no grouping
    (6, 2, 16),  # head_dim not a multiple of 32: the plain C loops
])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("shared", [0, 5])
def test_native_decode_matches_reference(heads, kv_heads, head_dim, contiguous, shared):
    seq_lens = [23, 61, 21, 40, 33]  # not multiples of the block size
    q, k, v, k_cache, v_cache, meta = mixed_step([1] * 5, seq_lens, torch.bfloat16,
                                                 contiguous, shared=shared, heads=heads,
                                                 kv_heads=kv_heads, head_dim=head_dim)
    plan = _DecodePlan(meta.block_tables, seq_lens, k_cache)
    assert plan.native and plan.shared == shared  # the paths under test are the ones taken
    scale = head_dim ** -0.5
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    fast = paged_attention_fast(q, k, v, k_cache, v_cache, meta, scale).float()
    assert_bf16_close(fast, ref)


@needs_kernel
def test_native_decode_reads_only_each_sequences_own_tokens():
    # slots past a sequence's end may hold anything (here NaN); the kernel never reads them
    seq_lens = [5, 17, 9]
    q, k, v, k_cache, v_cache, meta = mixed_step([1] * 3, seq_lens, torch.bfloat16, False,
                                                 heads=9, kv_heads=3, head_dim=64)
    written = torch.zeros(k_cache.shape[1:3], dtype=torch.bool)
    for table, n in zip(meta.block_tables.tolist(), seq_lens):
        for p in range(n):
            written[table[p // 4], p % 4] = True
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    k_cache[:, ~written] = float("nan")
    v_cache[:, ~written] = float("nan")
    fast = paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.125).float()
    assert_bf16_close(fast, ref)


def test_no_compiler_or_switched_off_means_the_torch_path(monkeypatch, fresh_build):
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))
    assert build.load("paged_decode") is None
    build.load.cache_clear()
    monkeypatch.delenv("CC")
    monkeypatch.setenv("TOKENMILL_NATIVE", "0")
    assert not native.available()
    seq_lens = [23, 30, 21]
    q, k, v, k_cache, v_cache, meta = mixed_step([1] * 3, seq_lens, torch.bfloat16, False)
    assert not _DecodePlan(meta.block_tables, seq_lens, k_cache).native
    ref = paged_attention_reference(q, k_cache, v_cache, meta, 0.25).float()
    fast = paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.25).float()
    torch.testing.assert_close(fast, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_a_build_is_reused_from_the_cache(fresh_build):
    assert build.load("paged_decode") is not None
    (so,) = (fresh_build / "kernels").glob("paged_decode-*.so")
    built_at = so.stat().st_mtime_ns
    build.load.cache_clear()  # a new process: finds the shared object, does not rebuild
    assert build.load("paged_decode") is not None
    assert [p.stat().st_mtime_ns for p in (fresh_build / "kernels").glob("*.so")] == [built_at]


def test_decode_plans_use_the_kernel_only_for_bf16_caches():
    _, _, _, k_cache, _, meta = mixed_step([1, 1], [9, 13], torch.float32, True)
    assert not _DecodePlan(meta.block_tables, [9, 13], k_cache).native  # fp32: exact path
    assert attention_fast.use_native(k_cache.bfloat16()) == native.available()
