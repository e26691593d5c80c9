"""Speculative decoding in the engine, on a tiny random Llama: outputs equal
to decoding without it, 100% acceptance with the target as its own draft,
the sampled distribution unchanged, no leaked KV blocks."""

from __future__ import annotations

import random

import pytest

from tests.engine.test_engine import first_divergence, near_tie
from tests.spec.conftest import assert_no_leak, make_llm
from tokenmill import SamplingParams

PROPOSERS = {
    "ngram": {"speculative": "ngram", "ngram_min": 1, "ngram_max": 3},
    "layerskip": {"speculative": "layerskip", "draft_layers": 2},
    "draft": {"speculative": "draft"},  # draft_model: the fixture's other tiny model
}


def spec_kwargs(name: str, draft_model: str) -> dict:
    kw = dict(PROPOSERS[name], num_speculative_tokens=4, spec_max_batch=64)
    if name == "draft":
        kw["draft_model"] = draft_model
    return kw


def grounded_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat spans of themselves, so prompt lookup finds matches."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        span = [rng.randrange(100, 49000) for _ in range(rng.randint(6, 30))]
        prompts.append(span + [rng.randrange(100, 49000)] + span[: rng.randint(2, len(span))])
    return prompts


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy outputs without speculation, each prompt alone."""
    llm = make_llm(tiny_model, num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    prompts = grounded_prompts(16)
    return prompts, params, [llm.generate([p], params, use_tqdm=False)[0].outputs[0]
                             for p in prompts]


def assert_same_up_to_near_ties(expected, got) -> None:
    identical = 0
    for want, out in zip(expected, got):
        assert len(out.token_ids) == len(want.token_ids)
        i = first_divergence(want.token_ids, out.token_ids)
        if i is None:
            identical += 1
        else:
            assert near_tie(want, out, i), f"diverged at {i}: {want.token_ids} {out.token_ids}"
    assert identical >= len(expected) - 1


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_greedy_outputs_equal_no_speculation_alone_and_batched(name, reference, tiny_model,
                                                              tiny_draft):
    prompts, params, expected = reference
    llm = make_llm(tiny_model, num_kv_blocks=256, **spec_kwargs(name, tiny_draft))
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    assert_same_up_to_near_ties(expected, alone)
    batched = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_same_up_to_near_ties(expected, batched)
    stats = llm.engine.get_stats()
    assert stats.spec_proposed_tokens > 0
    assert stats.spec_accepted_tokens > 0
    assert_no_leak(llm.engine)


def test_target_as_its_own_draft_accepts_every_token(tiny_model):
    llm = make_llm(tiny_model, num_kv_blocks=256, speculative="draft", draft_model=tiny_model,
                   num_speculative_tokens=3, spec_max_batch=64)
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    outs = llm.generate(grounded_prompts(4, seed=3), params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 17 for o in outs)
    stats = llm.engine.get_stats()
    assert stats.spec_proposed_tokens > 0
    assert stats.spec_acceptance_rate == 1.0
    # 3 accepted drafts + 1 bonus per step: 17 tokens = 1 from the prefill + 4 x 4
    assert stats.spec_mean_accepted_length == 4.0
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_no_leaked_blocks_after_rejections_aborts_and_preemption(name, tiny_model, tiny_draft):
    # 24 blocks x 16 = 384 token slots for 12 sequences of up to ~100: preemption
    llm = make_llm(tiny_model, num_kv_blocks=24, max_num_seqs=12,
                   **spec_kwargs(name, tiny_draft))
    engine = llm.engine
    rng = random.Random(5)
    prompts = grounded_prompts(12, seed=5)
    for i, p in enumerate(prompts):
        temp = 0 if i % 2 else 0.9
        engine.add_request(f"r{i}", p, SamplingParams(temperature=temp, max_tokens=40,
                                                      ignore_eos=True, seed=i))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps in (6, 12):  # abort some mid-flight, drafts and all
            engine.abort_request([f"r{rng.randrange(12)}", f"r{rng.randrange(12)}"])
    stats = engine.get_stats()
    assert stats.num_preemptions >= 1
    assert stats.spec_proposed_tokens > stats.spec_accepted_tokens  # there were rejections
    assert_no_leak(engine)
