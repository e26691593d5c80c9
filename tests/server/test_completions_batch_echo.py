"""Completions as vLLM and lm-eval-harness use them: batched prompts x n, echo
with prompt logprobs, vLLM's prompt_logprobs, cached_tokens, continuous usage."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _ids(server, text: str) -> list[int]:
    return httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}).json()["tokens"]


def _sse(server, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_batched_prompts_times_n_are_indexed_as_openai(client, server):
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
             .choices[0].text for p in PROMPTS]
    batch = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    r = client.completions.create(model=MODEL, prompt=batch, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:  # index = prompt_i * n + j
        assert c.text == alone[c.index // 2]
    prompt_tokens = sum(len(_ids(server, p)) for p in PROMPTS)
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens == 24
    by_ids = client.completions.create(model=MODEL, prompt=[_ids(server, p) for p in PROMPTS],
                                       max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == alone


def test_streamed_batch_delivers_every_choice(server):
    events = _sse(server, {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 5, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert sorted(texts) == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 20


def test_echo_with_logprobs_and_no_new_tokens_scores_the_prompt(client, server):
    ids = _ids(server, PROMPTS[0])
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == PROMPTS[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == PROMPTS[0]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)


def test_echo_then_greedy_token_is_scored_as_when_generated(client):
    gen = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=1,
                                    temperature=0, logprobs=0)
    token_lp = gen.choices[0].logprobs.token_logprobs[0]
    text = PROMPTS[1] + gen.choices[0].text
    echo = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True,
                                     logprobs=0)
    # the same token, scored once as generated and once as the prompt's last token
    assert echo.choices[0].logprobs.token_logprobs[-1] == pytest.approx(token_lp, abs=0.05)


def test_lm_eval_request_shape(server):
    """lm-eval-harness's local-completions loglikelihood: token-id batches, echo,
    logprobs=1, max_tokens=1, temperature 0; it reads token_logprobs[ctxlen:-1]."""
    contexts = [_ids(server, "Question: 2 + 2 = ? Answer:"), _ids(server, "The sky is")]
    conts = [_ids(server, " 4"), _ids(server, " blue")]
    body = {"model": MODEL, "prompt": [c + x for c, x in zip(contexts, conts)],
            "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice, ctx, cont in zip(choices, contexts, conts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ctx) + len(cont) + 1  # + the generated token
        scored = lp["token_logprobs"][len(ctx):-1]
        assert len(scored) == len(cont) and all(x < 0 for x in scored)
        tops = lp["top_logprobs"][len(ctx):-1]
        assert all(len(top) >= 1 for top in tops)


def test_vllm_prompt_logprobs_field(server):
    ids = _ids(server, PROMPTS[2])
    r = httpx.post(f"{server.base_url}/v1/completions", json={
        "prompt": PROMPTS[2], "max_tokens": 2, "prompt_logprobs": 3}, timeout=60).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:]):
        assert str(tid) in entry and 3 <= len(entry) <= 4
        assert all(v["rank"] >= 1 and v["logprob"] <= 0 and "decoded_token" in v
                   for v in entry.values())
    plain = httpx.post(f"{server.base_url}/v1/completions",
                       json={"prompt": PROMPTS[2], "max_tokens": 2}, timeout=60).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_streamed_echo_sends_the_prompt_first(server):
    events = _sse(server, {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0,
                           "echo": True, "stream": True})
    text = "".join(e["choices"][0]["text"] for e in events)
    assert events[0]["choices"][0]["text"].startswith(PROMPTS[0])
    plain = httpx.post(f"{server.base_url}/v1/completions", json={
        "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}, timeout=60).json()
    assert text == PROMPTS[0] + plain["choices"][0]["text"]


def test_cached_tokens_on_a_repeated_prompt(client):
    prompt = "A long shared system prompt about prefix caching. " * 8
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens


def test_continuous_usage_stats_on_every_chunk(server):
    events = _sse(server, {"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0,
                           "ignore_eos": True, "stream": True, "stream_options": {
                               "include_usage": True, "continuous_usage_stats": True}})
    counts = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert counts == sorted(counts) and counts[-1] == 4
    assert all(e["usage"]["prompt_tokens"] > 0 for e in events)
    assert events[-1]["choices"] == []


@pytest.mark.slow
def test_echoed_prompt_logprobs_equal_a_direct_forward_pass():
    """fp32 server vs transformers on the same GGUF: the logprob of every prompt token."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.serving import start_server
    from tokenmill.loaders import resolve_model

    source = resolve_model(MODEL)
    reference = AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32).eval()
    srv = start_server(MODEL, "--dtype", "float32", "--quantization", "none",
                       "--max-num-batched-tokens", "8")  # the prompt spans several chunks
    try:
        ids = _ids(srv, PROMPTS[0] + " Paris, and the capital of Italy is Rome.")
        r = httpx.post(f"{srv.base_url}/v1/completions", json={
            "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}, timeout=120).json()
    finally:
        srv.stop()
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = r["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    expected = [ref[t - 1, ids[t]].item() for t in range(1, len(ids))]
    assert got[1:] == pytest.approx(expected, abs=2e-3)
