"""The accuracy gate's prefill mode (benchmarks/accuracy.py --mode prefill): every
position of a window scored from one chunked prefill, through the prompt-attention
kernels, against the fp32 reference scored a decode step at a time."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.engine.conftest import small_engine
from tokenmill.attention import cpu
from tokenmill.engine.teacher_forced import score_prompts, score_windows
from tokenmill.kernels import paged_decode

TEXT = Path(__file__).resolve().parents[1] / "data" / "opticks_book1.txt"


@pytest.mark.slow  # an fp32 reference scored a decode step at a time
@pytest.mark.skipif(not paged_decode.available(), reason="paged_decode not built")
def test_prefill_scores_agree_with_the_fp32_reference_through_the_prompt_kernels(monkeypatch):
    fast = small_engine(max_num_batched_tokens=64)  # 64-token chunks of a 257-token window
    fp32 = small_engine(dtype="float32")
    ids = fp32.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    windows = [ids[:257], ids[257:514]]

    ran: Counter[str] = Counter()

    def counted(name, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            ran[name] += out is not None
            return out
        return call

    monkeypatch.setattr(cpu, "_prompt_native", counted("prompt", cpu._prompt_native))
    monkeypatch.setattr(cpu, "_extend_native", counted("cascade", cpu._extend_native))
    got = score_prompts(fast, windows)
    # each window's first chunks: the whole-prompt kernel; from 128 cached tokens (8
    # blocks) on, the chunk-over-prefix one: both in every layer for both windows
    assert ran["prompt"] >= 2 * 30 and ran["cascade"] >= 2 * 30, ran
    assert [len(w) for w in got.logprobs] == [256, 256]
    assert all(lp <= 0 for w in got.logprobs for lp in w)

    monkeypatch.undo()
    ref = score_windows(fp32, windows)  # every position a decode step, exact fp32
    assert got.agreement(ref) >= 0.95
    assert got.perplexity() == pytest.approx(ref.perplexity(), rel=0.02)
    # the engine is left as it was: nothing running, no KV block held
    assert not fast.has_unfinished_requests()
    assert fast.block_manager.num_free_blocks == fast.block_manager.num_total_blocks
