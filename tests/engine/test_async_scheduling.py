"""--async-scheduling: the same tokens as synchronous steps, with step N+1 scheduled
while step N computes; the fallbacks to a synchronous step; nothing leaked.

Greedy on the fp32 path is batch-invariant to far below any greedy margin
(test_engine.py), so async scheduling, which runs a sequence that just ended one
extra (discarded) step and admits new work a step later, must not change a token.
"""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import assert_no_leak
from tokenmill import LLM, SamplingParams
from tokenmill.cli.engine_args import add_engine_args, engine_config_from_args
from tokenmill.sequence import PLACEHOLDER_TOKEN_ID

ENGINE = {"dtype": "float32", "num_kv_blocks": 512, "max_num_seqs": 16}


@pytest.fixture(scope="module")
def sync_llm():
    return LLM("smollm2-135m", **ENGINE)


@pytest.fixture(scope="module")
def async_llm():
    return LLM("smollm2-135m", async_scheduling=True, **ENGINE)


def _key(out):
    return [(o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in out.outputs]


def _both(sync_llm, async_llm, prompts, params, expect_async=True):
    """Generate on both engines; the outputs must match exactly. Returns them."""
    sync_st, async_st = sync_llm.engine.stats, async_llm.engine.stats
    tokens = sync_st.generation_tokens
    a = sync_llm.generate(prompts, params, use_tqdm=False)
    tokens = sync_st.generation_tokens - tokens
    before, async_tokens = async_st.num_async_steps, async_st.generation_tokens
    b = async_llm.generate(prompts, params, use_tqdm=False)
    overlapped = async_st.num_async_steps - before
    assert [_key(x) for x in a] == [_key(x) for x in b]
    # the extra token computed for a sequence that had just ended is never counted
    assert async_st.generation_tokens - async_tokens == tokens
    assert (overlapped > 0) == expect_async, overlapped
    assert_no_leak(sync_llm.engine)
    assert_no_leak(async_llm.engine)
    return a


def test_mixed_lengths_and_ends_match_synchronous_steps(sync_llm, async_llm):
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(n)] for n in (3, 40, 170, 300, 17)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (1, 2, 9, 14, 23)]
    base = sync_llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=24),
                             use_tqdm=False)[0].outputs[0]
    # a stop token id the greedy output reaches at its 6th token, and a stop string
    # from the middle of the text: each ends its request at a different step
    stop_id = base.token_ids[5]
    stop_str = base.text[len(base.text) // 2: len(base.text) // 2 + 3]
    prompts += ["def fibonacci(n):"] * 2
    params += [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
               SamplingParams(temperature=0, max_tokens=24, stop=[stop_str])]
    outs = _both(sync_llm, async_llm, prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs[:5]] == [1, 2, 9, 14, 23]
    by_token, by_string = outs[5].outputs[0], outs[6].outputs[0]
    assert by_token.stop_reason == stop_id and len(by_token.token_ids) <= 6
    assert by_string.stop_reason == stop_str and stop_str not in by_string.text


def test_eos_ends_at_the_same_token(sync_llm, async_llm):
    msgs = [{"role": "user", "content": "Say just the word yes."}]
    params = SamplingParams(temperature=0, max_tokens=64)
    a = sync_llm.chat(msgs, params, use_tqdm=False)[0].outputs[0]
    b = async_llm.chat(msgs, params, use_tqdm=False)[0].outputs[0]
    assert a.finish_reason == "stop" and a.stop_reason is None  # EOS
    assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert_no_leak(async_llm.engine)


def test_seeded_sampling_and_n_samples_match(sync_llm, async_llm):
    prompts = ["Write a short poem about the sea.", "Tell me about cats.", "Numbers: 1, 2,"]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16),
              SamplingParams(temperature=1.0, top_k=50, seed=7, n=3, max_tokens=12,
                             ignore_eos=True),
              SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=10, logprobs=2)]
    outs = _both(sync_llm, async_llm, prompts, params)
    assert len(outs[1].outputs) == 3
    assert len({tuple(o.token_ids) for o in outs[1].outputs}) > 1


def test_n_samples_ending_at_different_steps(sync_llm, async_llm):
    """A sample that ends while its siblings run on must not grow in later outputs."""
    tok = sync_llm.tokenizer
    stops = [tok.encode(t, add_special_tokens=False)[0] for t in (".", ",", " and")]
    params = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=24, stop_token_ids=stops)
    out = _both(sync_llm, async_llm, ["Describe a walk in the forest"], params)[0]
    assert len({len(o.token_ids) for o in out.outputs}) > 1  # they did end apart


def test_logprobs_are_overlapped_and_match(sync_llm, async_llm):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    a = sync_llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
    before = async_llm.engine.stats.num_async_steps
    b = async_llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
    assert async_llm.engine.stats.num_async_steps > before
    assert b.token_ids == a.token_ids
    for la, lb in zip(a.logprobs, b.logprobs):
        assert la.keys() == lb.keys()
        assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 and la[t].rank == lb[t].rank
                   for t in la)


def _drive(engine, script):
    """Step the engine, adding / aborting at given step numbers; every output seen,
    per request, in order."""
    seen: dict[str, list] = {}
    step = 0
    while engine.has_unfinished_requests() or step in script:
        for action, rid, *rest in script.get(step, []):
            if action == "add":
                engine.add_request(rid, *rest)
            else:
                engine.abort_request(rid)
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
        step += 1
        assert step < 500
    return seen


def test_requests_added_and_aborted_mid_run(sync_llm, async_llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    script = {0: [("add", "a", "Once upon a time", greedy),
                  ("add", "b", "In a galaxy far away", greedy)],
              3: [("add", "c", "The quick brown fox", greedy)],
              6: [("abort", "b")],
              8: [("add", "d", [5, 6, 7] * 30, SamplingParams(temperature=0, max_tokens=5))],
              10: [("abort", "d")]}
    results = []
    for llm in (sync_llm, async_llm):
        seen = _drive(llm.engine, script)
        for rid, outs in seen.items():
            prev: list[int] = []
            for out in outs:  # streamed outputs only ever grow; no placeholder escapes
                ids = out.outputs[0].token_ids
                assert ids[:len(prev)] == prev and PLACEHOLDER_TOKEN_ID not in ids
                prev = ids
            assert not any(o.finished for o in outs) or rid in "ac"
        assert not any(o.finished for o in seen.get("b", []))
        results.append({rid: outs[-1].outputs[0].token_ids for rid, outs in seen.items()
                        if outs[-1].finished})
        assert_no_leak(llm.engine)
    assert results[0] == results[1] and set(results[0]) == {"a", "c"}
    assert all(len(ids) == 20 for ids in results[1].values())


@pytest.mark.slow
def test_preemption_under_a_tiny_kv_budget_matches(sync_llm):
    # 12 blocks of 16 tokens for six sequences of up to 69 tokens: they preempt
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(10, 45))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = sync_llm.generate(prompts, params, use_tqdm=False)
    tiny = LLM("smollm2-135m", dtype="float32", num_kv_blocks=12, max_num_seqs=8,
               async_scheduling=True)
    outs = tiny.generate(prompts, params, use_tqdm=False)
    stats = tiny.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_async_steps > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    assert stats.kv_cache_usage == 0.0
    assert_no_leak(tiny.engine)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, seed=5, max_tokens=10, frequency_penalty=0.5),
    SamplingParams(temperature=0, max_tokens=10, bad_words=["the"]),
], ids=["repetition_penalty", "frequency_penalty", "bad_words"])
def test_rows_that_need_host_tokens_run_synchronously(sync_llm, async_llm, params):
    out = _both(sync_llm, async_llm, ["The history of the city of Rome"], params,
                expect_async=False)[0]
    assert len(out.outputs[0].token_ids) == 10


def test_the_prompt_logprobs_step_runs_synchronously(sync_llm, async_llm):
    params = SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=2)
    prompt = "The history of the city of Rome"
    a = sync_llm.generate([prompt], params, use_tqdm=False)[0]
    st = async_llm.engine.stats
    steps, overlapped = st.num_steps, st.num_async_steps
    b = async_llm.generate([prompt], params, use_tqdm=False)[0]
    # the prompt's step records its logprobs on the host; the decode steps overlap
    assert (st.num_steps - steps) - (st.num_async_steps - overlapped) == 1
    assert _key(a) == _key(b)
    assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
    for la, lb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert la.keys() == lb.keys()
        assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)
    assert_no_leak(async_llm.engine)


def test_a_synchronous_row_in_a_batch_still_matches(sync_llm, async_llm):
    """Overlapped and synchronous steps alternate as a penalised request comes and goes."""
    prompts = ["Once upon a time", "The history of Rome", "List three colors:"]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, presence_penalty=1.0,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    _both(sync_llm, async_llm, prompts, params)


def test_structured_output_runs_synchronously(sync_llm, async_llm):
    pytest.importorskip("xgrammar")
    from tokenmill.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(
                                choice=["yes", "no", "maybe"]))
    out = _both(sync_llm, async_llm, ["Is the sky blue? Answer:"], params,
                expect_async=False)[0]
    assert out.outputs[0].text in ("yes", "no", "maybe")


def test_speculative_decoding_turns_async_scheduling_off(sync_llm):
    spec = LLM("smollm2-135m", dtype="float32", num_kv_blocks=256, speculative="ngram",
               async_scheduling=True)
    assert spec.engine.overlap is None
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"
    out = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == sync_llm.generate([prompt], params,
                                              use_tqdm=False)[0].outputs[0].token_ids
    assert spec.engine.stats.num_async_steps == 0
    assert_no_leak(spec.engine)


def test_the_flag_reaches_the_engine_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--async-scheduling"])).async_scheduling
    assert engine_config_from_args(parser.parse_args([])).async_scheduling is None  # per device


def test_decode_graph_buffers_take_the_placeholder_ids(tiny_model):
    """The torch backend on CPU decodes through the static buffers a CUDA graph
    replays (engine/cuda_graph.py): the previous step's ids are gathered into
    them on the device, and the batch shrinks through buckets as requests end."""
    engine = {"dtype": "float32", "attention_backend": "torch", "num_kv_blocks": 64,
              "max_num_seqs": 8, "max_model_len": 256}
    eager = LLM(tiny_model, enforce_eager=True, **engine)
    graphed = LLM(tiny_model, async_scheduling=True, **engine)
    assert graphed.engine.runner.graphs is not None
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randrange(3, 20))]
               for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (3, 12, 7, 20, 1, 9)]
    a = eager.generate(prompts, params, use_tqdm=False)
    b = graphed.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert graphed.engine.stats.num_async_steps > 0
    assert_no_leak(graphed.engine)
