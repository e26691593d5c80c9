"""Prompt chunks through the native decode kernel (cpu._prompt_native): each new token
is a row over the cached tokens up to itself, read in place from its blocks. A whole
prompt, and a chunk over a prefix too short for the cascade call, must match the torch
reference backend within bf16 rounding, and must not call SDPA. The tiled prompt kernel
(test_prompt_tiled.py) goes first where it applies; these tests turn it off."""

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


@pytest.fixture(autouse=True)
def rows_kernel(monkeypatch):
    monkeypatch.setattr(cpu, "PROMPT_TILED", False)  # TOKENMILL_PROMPT_TILED=0


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([37], [37]),  # a whole prompt, its last block part full
    ([5, 64, 2], [5, 64, 2]),  # three prompts in one step
    ([40], [75]),  # a chunk over a 35-token prefix: too short for the cascade call
    ([1, 30, 1], [20, 30, 9]),  # decode rows beside a prompt
])
def test_prompt_rows_match_the_reference_without_sdpa(contiguous, query_lens, seq_lens,
                                                      monkeypatch):
    q, k, v, k_cache, v_cache, meta = mixed_step(query_lens, seq_lens, torch.bfloat16,
                                                 contiguous)
    ref = paged_attention_reference(q, k_cache, v_cache, meta, 0.125)

    def no_sdpa(*args, **kwargs):
        raise AssertionError("a prompt chunk took SDPA")

    monkeypatch.setattr(cpu, "_attend", no_sdpa)
    out = paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.125)
    assert_bf16_close(out.float(), ref.float())


def test_large_chunks_and_fp32_keep_sdpa(monkeypatch):
    calls = []
    real = cpu._attend
    monkeypatch.setattr(cpu, "_attend", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(cpu, "MAX_EXTEND_QUERIES", 16)  # a prompt over the row limit
    q, k, v, k_cache, v_cache, meta = mixed_step([17], [17], torch.bfloat16, True)
    ref = paged_attention_reference(q, k_cache, v_cache, meta, 0.125)
    assert_bf16_close(paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.125).float(),
                      ref.float())
    assert calls
    calls.clear()
    q, k, v, k_cache, v_cache, meta = mixed_step([20], [20], torch.float32, True)
    paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.125)  # fp32 cache: SDPA
    assert calls
