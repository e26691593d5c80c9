"""--reasoning-parser qwen3 end to end: the embedded model behind Qwen3's chat
template, its output forced by a regex into a think block and an answer, split
into reasoning_content (chat, streamed and not) and a reasoning item
(/v1/responses); without the flag, nothing changes."""

import httpx
import openai
import pytest

MODEL = "smollm2-135m"
THINK = r"<think>[a-z]{2,8} [a-z]{2,8}</think>\n\n[A-Z][a-z]{2,8}\."
ASK = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def client(reasoning_server):
    return openai.OpenAI(base_url=f"{reasoning_server.base_url}/v1", api_key="x",
                         max_retries=0)


def _chat(client, **kwargs):
    body = {"structured_outputs": {"regex": THINK}}
    return client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                          max_tokens=40, extra_body=body, **kwargs)


def _unsplit(server) -> str:
    """The raw output, through /v1/completions (no parser there) on the same prompt."""
    prompt = httpx.post(f"{server.base_url}/tokenize", json={"messages": ASK}).json()["tokens"]
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 40, "temperature": 0,
        "structured_outputs": {"regex": THINK}})
    return r.json()["choices"][0]["text"]


def test_chat_reasoning_content_streamed_and_not(client, reasoning_server):
    raw = _unsplit(reasoning_server)
    thought, answer = raw.removeprefix("<think>").split("</think>\n\n")
    whole = _chat(client).choices[0].message
    assert whole.reasoning_content == thought and whole.content == answer
    reasoning, content = "", ""
    for chunk in _chat(client, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (thought, answer)


def test_think_never_closed_before_max_tokens(client):
    body = {"structured_outputs": {"regex": r"<think>[a-z]{2,6}( [a-z]{2,6}){20,40}</think>"}}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0,
                                           max_tokens=12, extra_body=body)
    assert whole.choices[0].finish_reason == "length"
    message = whole.choices[0].message
    assert message.content == "" and message.reasoning_content
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                       for c in client.chat.completions.create(
                           model=MODEL, messages=ASK, temperature=0, max_tokens=12,
                           extra_body=body, stream=True))
    assert streamed == message.reasoning_content


def test_enable_thinking_false_reaches_the_template(reasoning_server):
    ids = httpx.post(f"{reasoning_server.base_url}/tokenize", json={
        "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
    prompt = httpx.post(f"{reasoning_server.base_url}/detokenize",
                        json={"tokens": ids}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_responses_without_a_think_block_have_no_reasoning_item(client):
    r = client.responses.create(model=MODEL, input="What is two plus two?", temperature=0,
                                max_output_tokens=30)
    assert [o.type for o in r.output] == ["message"] and r.output_text
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_without_the_flag_nothing_changes(server):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0,
        "structured_outputs": {"regex": THINK}}).json()
    message = r["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert message["content"].startswith("<think>")
