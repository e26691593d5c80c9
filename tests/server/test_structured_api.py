"""Structured outputs, tool calls and token constraints through the official
`openai` client against a real `tokenmill serve` on the embedded model."""

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

MODEL = "smollm2-135m"
S = {"type": "string", "maxLength": 16}
I = {"type": "integer", "minimum": 0, "maximum": 999}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": I}, "required": ["name", "age"]},
    {"type": "object", "properties": {"city": S, "country": S, "population": I},
     "required": ["city", "country"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1,
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": I, "email": S}, "required": ["id", "email"]}}, "required": ["user"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": I},
     "required": ["ok", "score"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": S, "qty": I}, "required": ["sku", "qty"]}}},
     "required": ["items"]},
    {"type": "object", "properties": {"title": S, "year": I,
                                      "genre": {"enum": ["drama", "comedy", "horror"]}},
     "required": ["title", "year", "genre"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": I, "y": I}, "required": ["x", "y"]}, "label": S}, "required": ["point"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "reason": S},
     "required": ["answer", "reason"]},
]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": S,
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": S},
                                       "required": ["tz"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_at_temperature_one_validates(client, index):
    schema = SCHEMAS[index]
    r = client.chat.completions.create(
        model=MODEL, temperature=1.0, max_tokens=200, seed=index,
        messages=[{"role": "user", "content": "Reply with a JSON object."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": f"s{index}", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=100, response_format=City,
        messages=[{"role": "user", "content": "Name a city and its country."}])
    assert isinstance(r.choices[0].message.parsed, City)


def test_regex_choice_and_json_object_on_both_endpoints(client):
    r = client.completions.create(model=MODEL, prompt="Phone:", max_tokens=20, temperature=1.0,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=5,
        n=3, temperature=1.0, extra_body={"guided_choice": ["yes", "no"]})
    assert all(c.message.content in ("yes", "no") for c in r.choices)
    r = client.chat.completions.create(
        model=MODEL, max_tokens=60, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_logit_bias_bans_and_forces(client, server):
    prompt = "The capital of France is"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                     logprobs=0)
    first = base.choices[0].text
    token = httpx.post(f"{server.base_url}/tokenize",
                       json={"prompt": first, "add_special_tokens": False}).json()["tokens"][0]
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(token): -100})
    assert banned.choices[0].text != first
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=1.0,
                                       logit_bias={"42": 100})
    assert forced.usage.completion_tokens == 3
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [42] * 3}).json()
    assert forced.choices[0].text == text["prompt"]


def _tool_loop(client, **extra):
    r = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL,
                                       TIME_TOOL], tool_choice="required", temperature=0,
                                       max_tokens=100, **extra)
    return r


def test_two_turn_tool_loop_with_required(client):
    r = _tool_loop(client)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.id and call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in
                                                              choice.message.tool_calls]},
        *[{"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 21}'}
          for c in choice.message.tool_calls]]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL],
                                           tool_choice="none", temperature=0, max_tokens=30)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")


def test_named_tool_choice_and_parallel_off(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL], temperature=0,
        max_tokens=60, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    r = _tool_loop(client, parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1


def test_streamed_tool_call_deltas_reassemble_to_the_whole_response(client):
    whole = _tool_loop(client).choices[0].message.tool_calls
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in _tool_loop(client, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.function.name  # the first delta names the call
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert [calls[i] for i in sorted(calls)] == [[c.function.name, c.function.arguments]
                                                 for c in whole]
    assert finish == "tool_calls"


def _post(server, path, body):
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_unknown_fields_and_bad_constraints_are_400s(server):
    r = _post(server, "/v1/chat/completions", {"messages": ASK_WEATHER, "max_tokens": 1,
                                               "frobnicate": 1, "top_z": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "frobnicate"
    assert "Unrecognized request argument supplied: frobnicate, top_z" == err["message"]
    r = _post(server, "/v1/chat/completions", {
        "messages": ASK_WEATHER, "max_tokens": 1, "user": "u", "metadata": {"k": "v"},
        "store": False, "service_tier": "auto", "reasoning_effort": None})
    assert r.status_code == 200
    r = _post(server, "/v1/chat/completions", {
        "messages": ASK_WEATHER, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objectx"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    r = _post(server, "/v1/completions", {"prompt": "x", "guided_regex": "(ab"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
    r = _post(server, "/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice":
                                          ["a"]})
    assert r.status_code == 400
    r = _post(server, "/v1/chat/completions", {"messages": ASK_WEATHER, "tools": [WEATHER_TOOL]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"  # no parser
    r = _post(server, "/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
