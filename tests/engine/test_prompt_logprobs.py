"""prompt_logprobs: every prompt token scored as transformers scores it, whether
the prompt arrives in one step or in chunks, and when its prefix is cached."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import assert_no_leak
from tokenmill import LLM, SamplingParams

PROMPT = ("The quick brown fox jumps over the lazy dog. It was a bright cold day in April, "
          "and the clocks were striking thirteen. Call me Ishmael.")


@pytest.fixture(scope="module")
def reference_logprobs(llm):
    """(prompt ids, transformers' log_softmax at each position) from the same GGUF."""
    from transformers import AutoModelForCausalLM

    source = llm.engine.source
    model = AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32).eval()
    ids = llm.engine.tokenizer.encode(PROMPT)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return ids, torch.log_softmax(logits.float(), dim=-1)


def _check(out, ids: list[int], ref: torch.Tensor, k: int) -> None:
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids)
    assert plp[0] is None
    for t in range(1, len(ids)):
        entry = plp[t]
        assert abs(entry[ids[t]].logprob - ref[t - 1, ids[t]].item()) < 2e-3, t
        top = ref[t - 1].topk(k).indices.tolist()
        assert set(top) <= set(entry), t  # the chosen token plus the top k
        assert len(entry) <= k + 1


def test_prompt_logprobs_match_transformers(llm, reference_logprobs):
    ids, ref = reference_logprobs
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2),
                       use_tqdm=False)[0]
    _check(out, ids, ref, 2)
    assert_no_leak(llm.engine)


def test_prompt_logprobs_over_chunked_prefill_and_a_cached_prefix(reference_logprobs):
    ids, ref = reference_logprobs
    llm = LLM("smollm2-135m", dtype="float32", num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=16, block_size=16)
    warm = llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert warm.prompt_logprobs is None
    again = llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the prefix is cached ...
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # ... and not reused: it has no logits
    _check(out, ids, ref, 0)
    assert_no_leak(llm.engine)
