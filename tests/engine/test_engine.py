"""The engine on the embedded model: batching, preemption, prefix caching,
sampling, stops and aborts, as a user of `LLM.generate` sees them."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import assert_no_leak
from tokenmill import LLM, SamplingParams


@pytest.mark.slow
def test_batching_and_preemption_do_not_change_greedy_outputs():
    """docs/cpu-kernels.md: greedy output on the fp32 path does not depend on the batch. Batch
    composition moves fp32 logits only in the last bits (up to ~2e-5 measured, from
    different matmul shapes), far below any greedy margin of these prompts, so every
    output must be token-identical to the same prompt run alone, the preempted
    (recomputed) ones included."""
    rng = random.Random(0)
    lens = [4, 600] + [rng.randint(4, 600) for _ in range(62)]
    prompts = [[rng.randrange(100, 49000) for _ in range(n)] for n in lens]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 12), ignore_eos=True)
              for _ in prompts]
    # a cache of 160 blocks x 16 = 2,560 tokens for 64 prompts of ~300: preemption must happen
    llm = LLM("smollm2-135m", dtype="float32", num_kv_blocks=160, max_num_seqs=32,
              max_num_batched_tokens=1024, enable_prefix_caching=False)
    scheduler = llm.engine.scheduler
    preempted: set[str] = set()
    preempt = scheduler._preempt

    def record(seq):
        preempted.add(seq.request_id)
        preempt(seq)

    scheduler._preempt = record
    batched = llm.generate(prompts, params, use_tqdm=False)
    scheduler._preempt = preempt
    assert llm.engine.get_stats().num_preemptions >= 1 and preempted
    assert_no_leak(llm.engine)
    diverged, preempted_diverged = [], []
    for prompt, p, b in zip(prompts, params, batched):
        alone = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        assert len(b.outputs[0].token_ids) == p.max_tokens
        if alone.token_ids != b.outputs[0].token_ids:
            diverged.append(len(prompt))
            if b.request_id in preempted:
                preempted_diverged.append(len(prompt))
    assert preempted_diverged == [], "preempted sequences changed their greedy output"
    assert diverged == [], f"prompts of these lengths diverged: {diverged}"
    assert_no_leak(llm.engine)


def test_prefix_cache_computes_only_new_tokens(llm):
    rng = random.Random(1)
    prefix = [rng.randrange(100, 49000) for _ in range(512)]
    a = prefix + [rng.randrange(100, 49000) for _ in range(20)]
    b = prefix + [rng.randrange(100, 49000) for _ in range(24)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    llm.generate([a], greedy, use_tqdm=False)
    before = engine.get_stats().num_prefill_tokens
    out = llm.generate([b], greedy, use_tqdm=False)[0]
    computed = engine.get_stats().num_prefill_tokens - before
    assert out.num_cached_tokens == 512
    assert computed == len(b) - 512
    off = LLM("smollm2-135m", dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)
    assert off.generate([b], greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        out.outputs[0].token_ids
    assert_no_leak(engine)


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16,
                            ignore_eos=True)
    prompt = "Write a short poem about the sea."
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [f"Tell me fact number {i} about cats." for i in range(7)]
    busy = llm.generate(others[:3] + [prompt] + others[3:],
                        [SamplingParams(temperature=1.0, max_tokens=16)] * 3 + [seeded]
                        + [SamplingParams(temperature=1.0, max_tokens=16)] * 4,
                        use_tqdm=False)
    assert busy[3].outputs[0].token_ids == alone
    assert_no_leak(llm.engine)


def test_n_samples_share_the_prompt_blocks(llm):
    engine = llm.engine
    prompt = list(range(1000, 1000 + 100))  # 6 full blocks + 4 tokens
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=7,
                                                    max_tokens=6, ignore_eos=True))
    shared_seen = False
    result = None
    while engine.has_unfinished_requests():
        req = engine.requests.get("n4")
        if req and len(req.seqs) == 4 and all(s.block_table for s in req.seqs):
            tables = [s.block_table[:6] for s in req.seqs]
            shared_seen |= all(t == tables[0] for t in tables)
        for out in engine.step():
            if out.finished:
                result = out
    assert shared_seen, "the 4 samples did not share the prompt's full blocks"
    assert result is not None and len(result.outputs) == 4
    assert [o.index for o in result.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 6 for o in result.outputs)
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1
    assert_no_leak(engine)


def test_stop_string_split_across_tokens_is_found_and_not_emitted(llm):
    greedy = SamplingParams(temperature=0, max_tokens=40)
    prompt = "def fibonacci(n):"
    full = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text
    # pick a stop string that straddles a token boundary of the greedy output
    tok = llm.tokenizer
    ids = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    pieces = [tok.decode(ids[:i]) for i in range(1, len(ids) + 1)]
    cut = next(i for i in range(3, len(pieces)) if len(pieces[i]) - len(pieces[i - 1]) >= 2)
    stop = full[len(pieces[cut - 1]) - 2: len(pieces[cut - 1]) + 1]
    assert stop and stop in full
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    assert stop not in out.text


def test_min_tokens_and_max_tokens(llm):
    # the chat model answers briefly and stops with EOS; min_tokens forces it on
    msgs = [{"role": "user", "content": "Say just the word yes."}]
    short = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    out = short[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 40
    forced = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64, min_tokens=48),
                      use_tqdm=False)[0].outputs[0]
    assert len(forced.token_ids) >= 48
    capped = llm.generate(["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=5),
                          use_tqdm=False)[0].outputs[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 5


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))
    engine.add_request("b", "In a galaxy far away", SamplingParams(max_tokens=5))
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_total_blocks
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(engine)


def test_requests_that_can_never_fit_are_rejected_clearly(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request("big", [5] * 100, SamplingParams(max_tokens=engine.max_model_len))
    tiny = LLM("smollm2-135m", dtype="float32", num_kv_blocks=4)  # 64 tokens of cache
    with pytest.raises(ValueError, match="KV cache"):
        tiny.generate([[5] * 60], SamplingParams(max_tokens=10), use_tqdm=False)
    assert_no_leak(tiny.engine)
    assert_no_leak(engine)


def test_chat_renders_the_model_template(llm):
    msgs = [{"role": "user", "content": "Hi there"}]
    rendered = llm.render_chat(msgs)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nHi there<|im_end|>" in rendered
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out.prompt == rendered
    assert out.outputs[0].text.strip()
