"""Decode with LoRA adapters inside the fused native decode step (kernels/decode_step.c
and lora_delta.h add each adapter's low-rank products after each linear), on the
embedded SmolLM2-135M's quantized GGUF linears with adapters written by peft: at batch 1,
and in batches mixing the base and 3 adapters of different ranks (some projections
without an adapter), the same greedy tokens as each request alone on the module path
(models/lora.py), logprobs within a stated tolerance; through an adapter unloaded while
idle, its id reused by another adapter, and an eviction and reload."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.kernels import decode_step

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.skipif(not decode_step.available(), reason="decode_step not built")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPECS = {"a": (16, ALL), "b": (8, ["q_proj", "v_proj", "down_proj"]),
         "c": (4, ["k_proj", "o_proj", "gate_proj", "up_proj"]),
         "e": (12, ["q_proj", "k_proj", "gate_proj", "down_proj"])}
# Token ids, 3 a prompt: the six prefill together in fewer than 20 rows, where the
# module path's quantized linears keep the per-row kernel that each alone runs (from
# VNNI_DENSE_MIN_ROWS rows they take dense bf16 weights: other roundings, other tokens)
PROMPTS = [[504, 3575, 282], [1143, 28267, 30], [9038, 2115, 253], [378, 1450, 970],
           [10300, 29030, 418], [3152, 5055, 3761]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
# The kernel sums A x and B (A x) in its own (vector) order, torch in oneDNN's: a delta's
# bf16 rounding can fall the other way, which moves later bf16 activations; seen on these
# adapters: <= 0.07 on a chosen token's logprob over 8 tokens. On gguf-a8 (int8 inputs to
# the MLP and head) such a difference can also move a block's int8 rounding: where the
# module path's top two tokens lie within this tolerance of each other, either may come
# out (seen: 0.087 apart at the 8th token of adapter a's batch-1 run), and the sequences
# part there; and a chosen token's logprob moves further (seen: 0.105 in the batch of
# six), so gguf-a8 gets twice the tolerance.
LOGPROB_ATOL = 0.1
A8_LOGPROB_ATOL = 0.2


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """name -> directory of a peft adapter at SmolLM2-135M's shapes (SPECS' rank and
    targets), its weights random."""
    import transformers

    root = tmp_path_factory.mktemp("smollm2-adapters")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=576, intermediate_size=1536,
                                   num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, tie_word_embeddings=True)
    paths = {}
    for i, (name, (rank, targets)) in enumerate(SPECS.items()):
        model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0))
        torch.manual_seed(i)
        with torch.no_grad():  # deltas a fraction of the activations: the output changes
            for n, p in model.named_parameters():  # but stays a language model's
                if "lora_A" in n:
                    p.normal_(0, 0.05)
                elif "lora_B" in n:
                    p.normal_(0, 0.01)
        model.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


@pytest.fixture(scope="module", params=["gguf-a16", "gguf-a8"])
def llm(request):
    llm = LLM("smollm2-135m", enable_lora=True, max_loras=3, max_cpu_loras=3,
              max_lora_rank=16, quantization=request.param)
    assert llm.engine.runner.fused_decode is not None
    return llm


def _generate(llm: LLM, prompts: list[str], loras: list[LoRARequest | None]
              ) -> list[tuple[list[int], list[float], list[dict[int, float]]]]:
    """Per prompt: the greedy tokens, their logprobs, and each position's top two."""
    outs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
    return [(o.outputs[0].token_ids,
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
             [{t: x.logprob for t, x in lp.items()} for lp in o.outputs[0].logprobs])
            for o in outs]


def _alone_on_the_module_path(llm: LLM, prompts, loras):
    fused = llm.engine.runner.fused_decode
    fused.enabled = False
    try:
        return [_generate(llm, [p], [lora])[0] for p, lora in zip(prompts, loras)]
    finally:
        fused.enabled = True


def _same(got, want, llm: LLM) -> None:
    """The module path's tokens, up to the first position where its top two lie within
    the tolerance (a near-tie either path may take: the sequences part there), and their
    logprobs within it."""
    atol = A8_LOGPROB_ATOL if llm.engine.quantization == "gguf-a8" else LOGPROB_ATOL
    for i, ((tokens, logprobs, _), (want_tokens, want_logprobs, want_top)) in enumerate(
            zip(got, want)):
        n = next((j for j, (t, u) in enumerate(zip(tokens, want_tokens)) if t != u),
                 len(want_tokens))
        if n < len(want_tokens):
            top2 = sorted(want_top[n].values(), reverse=True)
            assert tokens[n] in want_top[n] and top2[0] - top2[1] < atol, (i, n)
        assert len(tokens) == len(want_tokens), i
        torch.testing.assert_close(torch.tensor(logprobs[:n]), torch.tensor(want_logprobs[:n]),
                                   atol=atol, rtol=0)


@pytest.fixture
def fused_calls(monkeypatch):
    """Each fused call: ("step", the adapter's records' address or None) or ("batch",
    its rows, its adapter slots)."""
    calls = []
    step, step_batch = decode_step.step, decode_step.step_batch

    def counted_step(*a):
        lora = a[8] if len(a) > 8 else None
        calls.append(("step", None if lora is None else ctypes.addressof(lora)))
        return step(*a)

    def counted_batch(*a):
        calls.append(("batch", a[1].shape[0], len(a[9] or []) if len(a) > 9 else 0))
        return step_batch(*a)
    monkeypatch.setattr(decode_step, "step", counted_step)
    monkeypatch.setattr(decode_step, "step_batch", counted_batch)
    return calls


def test_batch_one_decode_with_an_adapter_is_fused(llm, adapters, fused_calls):
    a, b = LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"])
    got = [_generate(llm, [PROMPTS[0]], [lora])[0] for lora in (a, b, None)]
    steps = [c for c in fused_calls if c[0] == "step"]
    assert len(steps) == 3 * (PARAMS.max_tokens - 1)  # every decode step was fused
    assert len({c[1] for c in steps}) == 3  # a's records, b's, and none for the base
    _same(got, _alone_on_the_module_path(llm, [PROMPTS[0]] * 3, [a, b, None]), llm)
    # the adapters change the output (so a step that dropped them fails above)
    assert got[0][0] != got[2][0] and got[1][0] != got[2][0]


def test_a_batch_of_the_base_and_three_adapters_is_fused(llm, adapters, fused_calls):
    a, b, c = (LoRARequest(n, i, adapters[n]) for i, n in ((1, "a"), (2, "b"), (3, "c")))
    loras = [None, a, b, c, a, None]
    got = _generate(llm, PROMPTS, loras)
    batches = [call for call in fused_calls if call[0] == "batch"]
    assert ("batch", 6, 3) in batches  # all six rows in one fused call, 3 adapter slots
    assert all(call[2] for call in batches)  # no decode step fell back to the modules
    assert not [call for call in fused_calls if call[0] == "step"]
    _same(got, _alone_on_the_module_path(llm, PROMPTS, loras), llm)
    # the adapters change their rows' output, and only theirs: the base rows give the
    # bits of an all-base step; each adapter row differs (a dropped delta would give the
    # base's bits), adapter a's (rank 16, all 7) by more than the tolerance
    base = _generate(llm, PROMPTS, [None] * 6)
    assert [got[i] != base[i] for i in range(6)] == [False, True, True, True, True, False]
    for i in (1, 4):
        assert got[i][0] != base[i][0] or max(
            abs(x - y) for x, y in zip(got[i][1], base[i][1])) > 2 * LOGPROB_ATOL


def test_unloaded_reused_and_evicted_adapters(llm, adapters, fused_calls):
    """b unloaded while idle; its id 2 then names another adapter (e: other rank and
    targets); a fourth adapter past --max-cpu-loras 3 evicts the least recently used
    idle one, which comes back from disk: every fused batch uses the adapters installed
    now, never records of one that is gone."""
    a, c = LoRARequest("a", 1, adapters["a"]), LoRARequest("c", 3, adapters["c"])
    _generate(llm, PROMPTS[:1], [LoRARequest("b", 2, adapters["b"])])
    fused = llm.engine.runner.fused_decode
    llm.engine.lora.remove("b")
    e = LoRARequest("e", 2, adapters["e"])  # b's id, another adapter
    loras = [e, c, None]
    got = _generate(llm, PROMPTS[:3], loras)
    assert ("batch", 3, 2) in fused_calls
    _same(got, _alone_on_the_module_path(llm, PROMPTS[:3], loras), llm)
    # loaded: a, c, e; d (b's file under a new name) evicts the least recently used idle
    # ones, c among them, as the batch's adapters are acquired
    d = LoRARequest("d", 4, adapters["b"])
    loras = [a, d, e]
    got = _generate(llm, PROMPTS[:3], loras)
    assert 3 not in llm.engine.lora.loaded
    assert 3 not in fused._adapters  # its cached records (and tensors) dropped
    _same(got, _alone_on_the_module_path(llm, PROMPTS[:3], loras), llm)
    loras = [c, None, a]  # c back from disk (evicting d)
    got = _generate(llm, PROMPTS[3:], loras)
    _same(got, _alone_on_the_module_path(llm, PROMPTS[3:], loras), llm)
