"""engine/core/validation.py: the one home of a request's checks against the model,
called by LLMEngine.add_request and by the server (no model needed here)."""

import pytest

from tokenmill.engine.core.validation import RequestError, RequestValidator
from tokenmill.sampling_params import SamplingParams


class _Tokenizer:
    """One id per character (ord % 100), a BOS of 1 when asked for."""

    def encode(self, text, add_special_tokens=False):
        return ([1] if add_special_tokens else []) + [ord(c) % 100 for c in text]


def _validator(cache_tokens=None):
    return RequestValidator(_Tokenizer(), vocab_size=100, max_model_len=32,
                            cache_tokens=(lambda: cache_tokens) if cache_tokens else None)


@pytest.mark.parametrize("prompt, param", [([], "prompt"), ([5, 100], "prompt"), ([-1], "prompt")])
def test_bad_prompts_name_the_prompt(prompt, param):
    with pytest.raises(RequestError) as e:
        _validator().admit(prompt, SamplingParams(max_tokens=4))
    assert e.value.param == param


def test_max_tokens_is_resolved_and_bounded_by_the_context():
    admitted = _validator().admit("abc", SamplingParams(max_tokens=None))
    assert admitted.prompt_token_ids == [1, 97, 98, 99]
    assert admitted.params.max_tokens == 32 - 4
    with pytest.raises(RequestError, match="maximum context length is 32") as e:
        _validator().admit("abc", SamplingParams(max_tokens=29))
    assert e.value.param == "max_tokens"


def test_a_request_the_cache_can_never_hold_is_refused():
    with pytest.raises(RequestError, match="KV cache") as e:
        _validator(cache_tokens=16).admit([5] * 4, SamplingParams(max_tokens=8, n=2))
    assert e.value.param == "max_tokens"
    _validator(cache_tokens=16).admit([5] * 4, SamplingParams(max_tokens=8))


def test_constraint_ids_and_bad_words():
    with pytest.raises(RequestError) as e:
        _validator().admit([5], SamplingParams(max_tokens=2, logit_bias={150: 1.0}))
    assert e.value.param == "logit_bias"
    params = _validator().admit([5], SamplingParams(max_tokens=2, bad_words=["ab"])).params
    assert sorted(params.bad_words_token_ids) == [[32, 97, 98], [97, 98]]


def test_the_server_check_is_the_same_check():
    with pytest.raises(RequestError, match=r"stop_token_ids must be in \[0, 100\)") as e:
        _validator().check_token_ids([3, 100], "stop_token_ids")
    assert e.value.param == "stop_token_ids"
