"""Speculative decoding in the engine, on a tiny random Llama: outputs equal
to decoding without it, 100% acceptance with the target as its own draft,
the sampled distribution unchanged, no leaked KV blocks."""

from __future__ import annotations

import random

import pytest

from tests.speculative.conftest import assert_no_leak, make_llm
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
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = grounded_prompts(16)
    return prompts, params, [llm.generate([p], params, use_tqdm=False)[0].outputs[0]
                             for p in prompts]


def assert_token_identical(expected, got) -> None:
    """Speculation is exact by construction: greedy tokens equal decoding without it."""
    assert [out.token_ids for out in got] == [want.token_ids for want in expected]


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_greedy_outputs_equal_no_speculation_alone_and_batched(name, reference, tiny_model,
                                                              tiny_draft):
    prompts, params, expected = reference
    llm = make_llm(tiny_model, num_kv_blocks=256, **spec_kwargs(name, tiny_draft))
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    assert_token_identical(expected, alone)
    batched = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_token_identical(expected, batched)
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


class FixedProposer:
    """Proposes the same continuation whatever was sampled: often right on a
    peaked model, often wrong, so both accept and reject paths run."""

    min_acceptance = 0.0
    runs_a_model = False

    def __init__(self, continuation: dict[int, list[int]]) -> None:
        self.continuation = continuation  # output length -> the drafts to propose

    def propose(self, seqs, k):
        return [self.continuation.get(s.num_output_tokens, [])[:n] for s, n in zip(seqs, k)]

    def forget(self, seqs):
        pass


def two_sample_chi_square_p(a: list[int], b: list[int]) -> float:
    """Do samples a and b (equal sizes) come from one distribution? Categories
    seen fewer than 10 times in both together are pooled."""
    from collections import Counter

    from tests.speculative.test_verify import chi_square_p_value

    ca, cb = Counter(a), Counter(b)
    cells, rare_a, rare_b = [], 0, 0
    for t in set(ca) | set(cb):
        if ca[t] + cb[t] >= 10:
            cells.append((ca[t], cb[t]))
        else:
            rare_a, rare_b = rare_a + ca[t], rare_b + cb[t]
    cells.append((rare_a, rare_b))
    # equal sample sizes: the two-sample statistic vs pooled expectations
    observed = [x for pair in cells for x in pair]
    expected = [(x + y) / 2 for x, y in cells for _ in (0, 1)]
    observed_expected = [(o, e) for o, e in zip(observed, expected) if e > 0]
    p = chi_square_p_value([o for o, _ in observed_expected], [e for _, e in observed_expected])
    return p


def test_sampled_tokens_have_the_distribution_of_no_speculation(tiny_model):
    """600 seeded samples of 3 tokens from one prompt, with and without
    speculation: the second and third tokens (the ones speculation produces)
    follow the same distribution. Fixed seeds: the test is deterministic."""
    prompt = grounded_prompts(1, seed=11)[0]
    n = 600
    params = [SamplingParams(temperature=1.0, top_k=50, max_tokens=3, ignore_eos=True, seed=i)
              for i in range(n)]

    def sample(speculative: bool) -> list[list[int]]:
        kw = {"speculative": "ngram", "num_speculative_tokens": 2, "spec_max_batch": n}
        llm = make_llm(tiny_model, num_kv_blocks=n * 2 + 8, max_num_seqs=n,
                       max_num_batched_tokens=n * 32, **(kw if speculative else {}))
        if speculative:
            greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3,
                                                           ignore_eos=True), use_tqdm=False)
            g = greedy[0].outputs[0].token_ids
            llm.engine.speculator.proposer = FixedProposer({1: g[1:3]})
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        if speculative:
            st = llm.engine.get_stats()
            assert 0 < st.spec_accepted_tokens < st.spec_proposed_tokens
        return [o.outputs[0].token_ids for o in outs]

    plain, spec = sample(False), sample(True)
    for pos in (1, 2):
        p = two_sample_chi_square_p([t[pos] for t in plain], [t[pos] for t in spec])
        assert p > 1e-3, f"token {pos}: p = {p}"
    # seeded draws are consumed differently with speculation, so the samples
    # differ one by one; only their distribution must not
    assert sum(a != b for a, b in zip(plain, spec)) > 0


@pytest.mark.slow
def test_ngram_on_smollm2_rewrite_is_greedy_identical_and_accepts_often():
    from tests.speculative.conftest import make_llm as make

    llm = make("smollm2-135m", num_kv_blocks=128, speculative="ngram",
               enable_prefix_caching=False)
    text = ("The city council met on Tuesday to discuss the new budget. After a long debate, "
            "the members agreed to increase funding for public libraries by ten percent.")
    msgs = [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}]
    params = SamplingParams(temperature=0, max_tokens=40)
    spec = llm.engine.speculator
    llm.engine.speculator = None
    plain = llm.chat(msgs, params, use_tqdm=False)[0].outputs[0]
    llm.engine.speculator = spec
    fast = llm.chat(msgs, params, use_tqdm=False)[0].outputs[0]
    assert_token_identical([plain], [fast])
    stats = llm.engine.get_stats()
    assert stats.spec_acceptance_rate > 0.3
    assert_no_leak(llm.engine)
