"""Batch-1 decode with a LoRA adapter inside the fused native decode step
(kernels/decode_step.c adds the adapter's low-rank products after each linear): the
same greedy tokens and logprobs as the module path (models/lora.py), on the embedded
SmolLM2-135M's quantized GGUF linears, with an adapter on all 7 projections."""

from __future__ import annotations

import pytest
import torch

from benchmarks.features.lora_overhead import write_adapter
from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.kernels import decode_step

pytestmark = pytest.mark.skipif(not decode_step.available(), reason="decode_step not built")

PROMPT = "The capital of France is"
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)


def _run(llm: LLM, lora: LoRARequest | None) -> tuple[list[int], list[float]]:
    out = llm.generate([PROMPT], PARAMS, use_tqdm=False, lora_request=lora)[0].outputs[0]
    return out.token_ids, [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


def test_fused_step_applies_the_adapter_as_the_module_path_does(tmp_path, monkeypatch):
    write_adapter(tmp_path / "a", rank=16, seed=0, b_std=0.05)
    write_adapter(tmp_path / "b", rank=8, seed=1, b_std=0.05)
    llm = LLM("smollm2-135m", enable_lora=True, max_loras=2, max_lora_rank=16)
    fused = llm.engine.runner.fused_decode
    assert fused is not None
    calls = []
    step = decode_step.step
    monkeypatch.setattr(decode_step, "step",  # which layer records each call named
                        lambda *a: calls.append(ctypes_address(a[0].layers)) or step(*a))
    a, b = LoRARequest("a", 1, str(tmp_path / "a")), LoRARequest("b", 2, str(tmp_path / "b"))
    got = {name: _run(llm, lora) for name, lora in (("a", a), ("b", b), ("base", None))}
    assert len(calls) == 3 * (PARAMS.max_tokens - 1)  # every decode step was fused
    # the adapters' steps named their own layer records, the base's the plain ones
    assert len(set(calls)) == 3

    fused.enabled = False  # the module path: LoRALinear adds the deltas
    want = {name: _run(llm, lora) for name, lora in (("a", a), ("b", b), ("base", None))}
    assert len(calls) == 3 * (PARAMS.max_tokens - 1)
    for name in got:
        assert got[name][0] == want[name][0], name
        # not bit for bit: the kernel sums A x and B (A x) in its own order (fp32, each
        # rounded to bf16 as torch's bf16 products are), and a bf16 rounding that falls
        # the other way moves a later layer's input; seen: <= 0.07 over 12 tokens
        torch.testing.assert_close(torch.tensor(got[name][1]), torch.tensor(want[name][1]),
                                   atol=0.1, rtol=0)
    # the adapters change the output (so a step that dropped them fails above)
    assert got["a"][0] != got["base"][0] and got["b"][0] != got["base"][0]


def ctypes_address(pointer) -> int:
    import ctypes

    return ctypes.cast(pointer, ctypes.c_void_p).value
