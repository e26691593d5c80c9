"""The sampler's batched constraint pass on hand-made logits (no model)."""

import pytest
import torch

from tokenmill.engine.core.sampler import Sampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams as Structured
from tokenmill.sequence import Sequence
from tokenmill.structured import GrammarCache, LogitsConstraints

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer():
    from tokenmill.loaders import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module")
def constraints(tokenizer):
    return LogitsConstraints(GrammarCache(tokenizer, VOCAB, [2]))


def _seq(**kw):
    return Sequence("r", [1, 2, 3], SamplingParams(temperature=0, **kw))


def test_unconstrained_batch_is_untouched(constraints):
    logits = torch.randn(3, VOCAB)
    out = constraints.apply(logits, [_seq(), _seq(), _seq()])
    assert out is logits


def test_bias_allowed_and_bad_words_touch_only_their_rows(constraints):
    logits = torch.zeros(4, VOCAB)
    seqs = [_seq(), _seq(logit_bias={7: 100.0}), _seq(allowed_token_ids=[5, 9]),
            _seq(bad_words_token_ids=[[11], [3, 12]])]
    out = constraints.apply(logits, seqs)
    assert torch.equal(out[0], logits[0])
    assert out[1].argmax() == 7 and out[1, 7] == 100.0
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [5, 9]
    # [11] is always banned; [3, 12] only after a 3 (the prompt ends in 3, the output is empty)
    assert out[3, 11] == float("-inf") and out[3, 12] == 0.0
    seqs[3].append_token(3)
    assert constraints.apply(logits, seqs)[3, 12] == float("-inf")


def test_grammar_rows_allow_only_grammar_tokens(constraints, tokenizer):
    spec = Structured(choice=["yes", "no"])
    constraints.grammars.submit(spec).result()
    seqs = [_seq(), _seq(structured_outputs=spec)]
    out = constraints.apply(torch.zeros(2, VOCAB), seqs)
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no")
                           for t in allowed), [tokenizer.decode([t]) for t in allowed]
    assert torch.isfinite(out[0]).all()


def test_contradictory_constraints_fall_back_to_the_grammar(constraints, tokenizer):
    spec = Structured(choice=["yes"])
    constraints.grammars.submit(spec).result()
    never = tokenizer.encode("zebra", add_special_tokens=False)[0]
    seq = _seq(structured_outputs=spec, allowed_token_ids=[never])
    out = constraints.apply(torch.zeros(1, VOCAB), [seq])
    assert torch.isfinite(out).any() and not torch.isfinite(out[0, never])


def test_sampler_greedy_follows_the_constraint(constraints):
    sampler = Sampler([2], constraints)
    logits = torch.zeros(2, VOCAB)
    logits[:, 100] = 10.0
    out = sampler(logits, [_seq(), _seq(logit_bias={200: 50.0})])
    assert out.token_ids == [100, 200]


def test_grammar_rows_of_a_mixed_batch_allow_exactly_the_grammars_tokens(constraints,
                                                                          tokenizer):
    # rows 0 and 2 carry a choice grammar, rows 1 and 3 none: the constrained rows keep
    # finite logits exactly where the matcher allows a token, the others are untouched
    import xgrammar as xgr

    logits = torch.randn(4, VOCAB)
    spec = Structured(choice=["yes", "no"])
    seqs = [_seq(structured_outputs=spec), _seq(), _seq(structured_outputs=spec), _seq()]
    out = constraints.apply(logits, seqs)
    matcher = xgr.GrammarMatcher(constraints.grammars.submit(spec).result())
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(mask, 0)
    bits = (mask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(-1)[:VOCAB].bool()
    first = {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no")}
    assert first <= set(allowed.nonzero().flatten().tolist())
    for row in (0, 2):
        assert torch.equal(torch.isfinite(out[row]), allowed)
        assert torch.equal(out[row][allowed], logits[row][allowed])
    for row in (1, 3):
        assert torch.equal(out[row], logits[row])
