"""The tiny Gemma 3 of tests/model/test_gemma3.py (window 8, prompts up to 43 tokens)
on the triton backend under the interpreter: the same greedy tokens as transformers
through preemption and prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_triton_engine import no_overflow_checks  # noqa: F401 (fixture)
from tests.model.test_gemma3 import _engine_greedy, gemma_dir, hf_greedy  # noqa: F401

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="CUDA is present: the kernels run compiled, on the GPU"),
              pytest.mark.usefixtures("interpreter", "no_overflow_checks")]


@pytest.mark.slow
def test_triton_backend_gives_transformers_greedy_tokens(gemma_dir, hf_greedy):  # noqa: F811
    steps = 6
    got, stats = _engine_greedy(gemma_dir[0], "triton", steps, num_kv_blocks=7)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits >= 2 * 8
    assert got == hf_greedy(steps)
