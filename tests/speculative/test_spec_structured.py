"""Speculative decoding with constrained requests: they decode without drafts
(drafts are verified against the unconstrained target), so they stay exact and
valid while unconstrained neighbours still speculate."""

import re

from tests.speculative.conftest import assert_no_leak, make_llm
from tokenmill.sampling_params import SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams as Structured

REGEX = r"[a-z]{3,8}-\d{2}"


def test_constrained_rows_are_exact_beside_speculating_ones(tiny_model):
    plain = make_llm(tiny_model, num_kv_blocks=256)
    spec = make_llm(tiny_model, num_kv_blocks=256, speculative="ngram",
                    num_speculative_tokens=3)
    prompts = ["one two three one two three one two", "a b c a b c a b"]
    constrained = SamplingParams(temperature=0, max_tokens=20,
                                 structured_outputs=Structured(regex=REGEX))
    greedy = SamplingParams(temperature=0, max_tokens=20)
    params = [constrained, greedy]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert re.fullmatch(REGEX, got[0].outputs[0].text)
    assert spec.engine.get_stats().spec_proposed_tokens > 0  # the other row did speculate
    assert_no_leak(spec.engine)
