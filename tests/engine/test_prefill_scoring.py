"""The accuracy gate's prefill mode (benchmarks/accuracy.py --mode prefill): every
position of a window scored from one chunked prefill, through the prompt-attention
kernel (whole prompts and chunks over the cached part alike), against the fp32
reference scored a decode step at a time."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.engine.conftest import small_engine
from tokenmill.attention import cpu
from tokenmill.engine.core.teacher_forced import score_prompts, score_windows
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

    def no_sdpa(*args, **kwargs):
        raise AssertionError("a prompt chunk took SDPA")

    monkeypatch.setattr(cpu, "_prompt_tiled", counted("tiled", cpu._prompt_tiled))
    monkeypatch.setattr(cpu, "_attend", no_sdpa)
    got = score_prompts(fast, windows)
    # every chunk of both windows (at least 4 of 64 tokens and the last one each) in
    # every layer: the tiled prompt kernel
    assert ran["tiled"] >= 2 * 5 * 30, ran
    assert [len(w) for w in got.logprobs] == [256, 256]
    assert all(lp <= 0 for w in got.logprobs for lp in w)

    monkeypatch.undo()
    ref = score_windows(fp32, windows)  # every position a decode step, exact fp32
    assert got.agreement(ref) >= 0.95
    assert got.perplexity() == pytest.approx(ref.perplexity(), rel=0.02)
    # the engine is left as it was: nothing running, no KV block held
    assert not fast.has_unfinished_requests()
    assert fast.block_manager.num_free_blocks == fast.block_manager.num_total_blocks
