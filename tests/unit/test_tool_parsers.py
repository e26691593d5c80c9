"""Tool-call parsers on outputs recorded in each format, whole and streamed in
random chunkings: the streamed deltas must reassemble to the whole parse."""

import json
import random

import pytest

from tokenmill.tools import JsonArrayParser, NamedParser, ToolCallStream, get_parser

WEATHER = {"city": "San Francisco", "unit": "celsius"}
# (parser, output text, expected content, expected [(name, arguments)])
RECORDED = [
    ("hermes", ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco", '
     '"unit": "celsius"}}\n</tool_call>'), None, [("get_weather", WEATHER)]),
    ("hermes", ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "San Francisco", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": '
     '"get_time", "arguments": {"tz": "PST", "nested": {"a": [1, 2, "}"]}}}\n</tool_call>'),
     "Let me check both.\n",
     [("get_weather", WEATHER), ("get_time", {"tz": "PST", "nested": {"a": [1, 2, "}"]}})]),
    ("hermes", "The weather is sunny <b>today</b>.", "The weather is sunny <b>today</b>.", []),
    ("llama3_json", ('{"name": "get_weather", "parameters": {"city": "San Francisco", '
     '"unit": "celsius"}}'), None, [("get_weather", WEATHER)]),
    ("llama3_json", ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "San '
     'Francisco", "unit": "celsius"}}; {"name": "get_time", "parameters": {}}'), None,
     [("get_weather", WEATHER), ("get_time", {})]),
    ("llama3_json", "It is 20 degrees {roughly}.", "It is 20 degrees {roughly}.", []),
    ("mistral", ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "San Francisco", '
     '"unit": "celsius"}}, {"name": "get_time", "arguments": {"tz": "PST"}}]'), None,
     [("get_weather", WEATHER), ("get_time", {"tz": "PST"})]),
    ("mistral", ('Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "San Francisco", "unit": '
     '"celsius"}'), "Sure. ", [("get_weather", WEATHER)]),
    ("mistral", "No tools [needed] here.", "No tools [needed] here.", []),
    ("pythonic", ('[get_weather(city="San Francisco", unit=\'celsius\'), get_time(tz="P(S)T", '
     "offsets=[1, -2], opts={'dst': True})]"), None,
     [("get_weather", WEATHER), ("get_time", {"tz": "P(S)T", "offsets": [1, -2],
                                              "opts": {"dst": True}})]),
    ("pythonic", "<|python_start|>[get_weather(city='San Francisco', unit='celsius')]", None,
     [("get_weather", WEATHER)]),
    ("pythonic", "Paris is the capital.", "Paris is the capital.", []),
]


def _expected(calls):
    return [(name, args) for name, args in calls]


def _parsed(parser, text):
    out = parser.parse(text)
    return out.content, [(c.name, json.loads(c.arguments)) for c in out.tool_calls], out


@pytest.mark.parametrize("name,text,content,calls", RECORDED)
def test_whole_output_parses(name, text, content, calls):
    got_content, got_calls, out = _parsed(get_parser(name), text)
    assert got_content == content
    assert got_calls == _expected(calls)
    assert all(c.id.startswith("call_") for c in out.tool_calls)


def _stream(parser, text, rng):
    stream = ToolCallStream(parser)
    content, calls, cut = "", {}, 0
    first_deltas = {}
    while cut < len(text):
        cut = min(len(text), cut + rng.randint(1, 7))
        piece, deltas = stream.update(text[:cut], final=False)
        content += piece
        _one_per_call(deltas)
        for d in deltas:
            _add(calls, first_deltas, d)
    piece, deltas = stream.update(text, final=True)
    content += piece
    _one_per_call(deltas)
    for d in deltas:
        _add(calls, first_deltas, d)
    for d in first_deltas.values():  # OpenAI: the first delta of a call has id, type, name
        assert d["id"].startswith("call_") and d["type"] == "function"
        assert d["function"]["name"]
    return content, [calls[i] for i in sorted(calls)]


def _one_per_call(deltas):
    indexes = [d["index"] for d in deltas]
    assert len(indexes) == len(set(indexes)), deltas


def _add(calls, first_deltas, delta):
    i = delta["index"]
    if i not in calls:
        first_deltas[i] = delta
        calls[i] = [delta["function"]["name"], ""]
    else:
        assert "id" not in delta and "name" not in delta["function"]
    calls[i][1] += delta["function"].get("arguments", "")


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("name,text,content,calls", RECORDED)
def test_streamed_deltas_reassemble_to_the_whole_parse(name, text, content, calls, seed):
    parser = get_parser(name)
    whole = parser.parse(text)
    got_content, got_calls = _stream(parser, text, random.Random(seed))
    assert got_content == (whole.content or "")
    assert [(n, a) for n, a in got_calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_content_never_leaks_a_partial_marker():
    stream = ToolCallStream(get_parser("hermes"))
    sent = ""
    for cut in range(1, 20):
        piece, _ = stream.update("Checking.<tool_call>"[:cut], final=False)
        sent += piece
        assert "<" not in sent


def test_required_array_and_named_formats():
    array = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    out = JsonArrayParser().parse(array)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("a", '{"x": 1}'), ("b", "{}")]
    named = NamedParser("get_weather")
    _, calls = _stream(named, '{"city": "Paris"}', random.Random(0))
    assert calls == [["get_weather", '{"city": "Paris"}']]


def test_a_named_call_cut_by_max_tokens_is_still_the_call():
    """A named tool_choice's output is that function's arguments; cut short by
    max_tokens they are not valid JSON, and the response still carries the call with
    them (as OpenAI and vLLM do, and as the stream sends it), not the text as content:
    instructor validates the arguments and retries; it found no call at all before."""
    cut = '{"city": "Nottingham", "country": "Nether'
    out = NamedParser("City").parse(cut)
    assert out.content is None
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("City", cut)]
    _, calls = _stream(NamedParser("City"), cut, random.Random(0))
    assert calls == [["City", cut]]


def test_a_call_opens_with_its_first_arguments_in_one_delta():
    """One delta per call per chunk, as OpenAI: langchain merges a stream's deltas by
    index across chunks, so a second index-0 delta in the first chunk lost the
    call's name and id (a named tool_choice streamed to bind_tools came back nameless)."""
    stream = ToolCallStream(NamedParser("get_weather"))
    _, deltas = stream.update('{"city": "Pa', final=False)
    assert deltas == [{"index": 0, "id": stream.ids[0], "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}]
    _, deltas = stream.update('{"city": "Paris"}', final=True)
    assert deltas == [{"index": 0, "function": {"arguments": 'ris"}'}}]


def test_malformed_call_is_text():
    text = '<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>'
    out = get_parser("hermes").parse(text)
    assert out.tool_calls == [] and out.content == text
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")


@pytest.mark.parametrize("name", ["pythonic", "llama3_json", "mistral"])
def test_text_that_merely_starts_like_a_call_is_content(name):
    text = {"pythonic": "[needed] no call", "llama3_json": '{"a": 1} is json',
            "mistral": "[TOOL_CALLS] oops"}[name]
    out = get_parser(name).parse(text)
    assert out.tool_calls == [] and out.content == text
