"""--reasoning-parser: the <think>...</think> span split from the answer, driven
with fixed token streams through the embedded tokenizer (the think tags as text)
and decoded one token at a time as the server streams them."""

import pytest

from tokenmill.server.reasoning import ReasoningStream, get_reasoning_parser

THOUGHT = "\nThe user asks 2+2. That is 4.\n"
ANSWER = "2 + 2 = 4."


@pytest.fixture(scope="module")
def tokenizer():
    from tokenmill.loaders import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("smollm2-135m"))


def _streamed(tokenizer, parser_name: str, text: str, max_tokens: int | None = None):
    """(reasoning, content, the non-streamed split) of `text` cut at `max_tokens`,
    streamed as a server decodes it: the whole text so far after every token."""
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    parser = get_reasoning_parser(parser_name)
    stream = ReasoningStream(parser)
    reasoning, content = "", ""
    for n in range(1, len(ids) + 1):
        r, c, _ = stream.update(tokenizer.decode(ids[:n]), final=n == len(ids))
        reasoning, content = reasoning + r, content + c
    whole = parser.split(tokenizer.decode(ids), final=True)
    return reasoning, content, whole


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_think_block_split_streamed_and_not(tokenizer, parser):
    reasoning, content, whole = _streamed(tokenizer, parser,
                                          f"<think>{THOUGHT}</think>\n\n{ANSWER}")
    assert (reasoning, content) == (THOUGHT, ANSWER)
    assert (whole.reasoning, whole.content) == (THOUGHT, ANSWER)


def test_deepseek_r1_reasoning_opened_by_the_prompt(tokenizer):
    reasoning, content, whole = _streamed(tokenizer, "deepseek_r1",
                                          f"{THOUGHT}</think>\n\n{ANSWER}")
    assert (reasoning, content) == (THOUGHT, ANSWER) == (whole.reasoning, whole.content)


@pytest.mark.parametrize("parser,expected_reasoning", [("qwen3", None),
                                                       ("deepseek_r1", ANSWER)])
def test_no_think_tags(tokenizer, parser, expected_reasoning):
    # qwen3 with enable_thinking false: no tags, all answer; R1: never closed, all reasoning
    reasoning, content, whole = _streamed(tokenizer, parser, ANSWER)
    assert whole.reasoning == expected_reasoning
    assert content == whole.content == ("" if expected_reasoning else ANSWER)
    assert reasoning == (expected_reasoning or "")


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_think_never_closed_before_max_tokens(tokenizer, parser):
    text = f"<think>{THOUGHT * 5}</think>\n\n{ANSWER}"
    reasoning, content, whole = _streamed(tokenizer, parser, text, max_tokens=12)
    assert content == whole.content == ""
    assert reasoning == whole.reasoning
    assert THOUGHT.startswith(reasoning) and len(reasoning) > 5
    assert "<think>" not in reasoning and "</" not in reasoning


def test_partial_close_tag_held_back_until_it_is_one(tokenizer):
    parser = get_reasoning_parser("qwen3")
    assert parser.split("<think>abc</th", final=False).reasoning == "abc"
    assert parser.split("<think>abc</th", final=True).reasoning == "abc</th"
    assert parser.split("<thi", final=False).content == ""  # may still open a block
    assert parser.split("<thi", final=True).content == "<thi"


def test_unknown_parser_named():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("granite")


def _responses_output(tokenizer, text: str, max_tokens: int | None = None):
    """The /v1/responses output items of `text`, built streamed (as the server streams
    them, token by token) and whole; both with their events."""
    from tokenmill.server.responses.output import OutputBuilder

    ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    status = "incomplete" if max_tokens else "completed"
    streamed = OutputBuilder(None, get_reasoning_parser("qwen3"))
    events = []
    for n in range(1, len(ids) + 1):
        events += streamed.update(tokenizer.decode(ids[:n]), n == len(ids), status)
    whole = OutputBuilder(None, get_reasoning_parser("qwen3"))
    whole.update(tokenizer.decode(ids), True, status)
    return streamed.items, whole.items, [e["type"] for e in events]


def _strip_ids(items):
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


def test_responses_reasoning_item_streamed_and_not(tokenizer):
    streamed, whole, events = _responses_output(tokenizer,
                                                f"<think>{THOUGHT}</think>\n\n{ANSWER}")
    assert _strip_ids(streamed) == _strip_ids(whole)
    reasoning, message = whole
    assert reasoning["type"] == "reasoning" and reasoning["status"] == "completed"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert message["content"][0]["text"] == ANSWER
    assert events[0] == "response.output_item.added"
    assert "response.reasoning_text.delta" in events
    assert events.index("response.reasoning_text.done") < events.index(
        "response.output_text.delta")


def test_responses_reasoning_never_closed(tokenizer):
    streamed, whole, events = _responses_output(
        tokenizer, f"<think>{THOUGHT * 5}</think>\n\n{ANSWER}", max_tokens=12)
    assert _strip_ids(streamed) == _strip_ids(whole)
    reasoning, = whole  # no answer began: no message item
    assert reasoning["status"] == "incomplete"
    assert THOUGHT.startswith(reasoning["content"][0]["text"])
    assert "response.output_text.delta" not in events
