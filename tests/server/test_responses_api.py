"""/v1/responses through the official `openai` SDK (and the openai-agents SDK)
against a real `tokenmill serve` on the embedded model."""

import json
import time

import httpx
import jsonschema
import openai
import pydantic
import pytest

MODEL = "smollm2-135m"
S = {"type": "string", "maxLength": 16}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": S}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_plain_create_then_get_and_delete(client):
    r = client.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.",
                                max_output_tokens=40, temperature=0)
    assert r.object == "response" and r.model == MODEL
    assert r.output[0].type == "message" and r.output_text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_max_output_tokens_makes_it_incomplete_streamed_and_not(client):
    r = client.responses.create(model=MODEL, input="Write a long story about a dragon.",
                                max_output_tokens=5, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5
    events = list(client.responses.create(model=MODEL, input="Write a long story about a "
                                          "dragon.", max_output_tokens=5, temperature=0,
                                          stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output[0].content[0].text == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_streamed_events_assemble_to_the_unstreamed_response(client):
    kwargs = {"model": MODEL, "input": "Name three colors.", "max_output_tokens": 200,
              "temperature": 0}
    client.responses.create(**kwargs)  # the prompt now in the prefix cache for both runs
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        types = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert "response.output_text.delta" in types
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert streamed.status == whole.status == "completed"
    assert streamed.output_text == whole.output_text
    assert streamed.usage == whole.usage
    assert [o.type for o in streamed.output] == [o.type for o in whole.output]


def test_tool_call_round_trip_with_function_call_output(client):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                    tools=[WEATHER], tool_choice="required", temperature=0,
                                    max_output_tokens=60)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    # the whole conversation sent back, as a stateless client (store=False) does
    follow_up = client.responses.create(
        model=MODEL, store=False, tools=[WEATHER], tool_choice="none", temperature=0,
        max_output_tokens=40,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               *[c.model_dump(exclude_none=True) for c in calls],
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": json.dumps({"temperature_c": 21})}])
    assert follow_up.output_text and follow_up.output[0].type == "message"
    with pytest.raises(openai.NotFoundError):  # store=False: not kept
        client.responses.retrieve(follow_up.id)


def test_streamed_tool_call_events(client):
    with client.responses.stream(model=MODEL, input="What is the weather in Rome?",
                                 tools=[WEATHER], tool_choice={"type": "function",
                                                               "name": "get_weather"},
                                 temperature=0, max_output_tokens=60) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in types
    assert "response.function_call_arguments.done" in types
    call, = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert "city" in json.loads(call.arguments)


def test_json_schema_text_format_validates(client):
    schema = {"type": "object", "properties": {"name": S, "age": {"type": "integer",
              "minimum": 0, "maximum": 150}}, "required": ["name", "age"]}
    r = client.responses.create(model=MODEL, input="Describe a person as JSON.", temperature=1.0,
                                max_output_tokens=100, text={"format": {
                                    "type": "json_schema", "name": "person", "schema": schema,
                                    "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


def test_parse_with_a_pydantic_model(client):
    r = client.responses.parse(model=MODEL, input="Name a city and its country.",
                               text_format=City, temperature=0, max_output_tokens=100)
    assert isinstance(r.output_parsed, City)


def test_previous_response_id_continues_the_conversation(client, server):
    first = client.responses.create(model=MODEL, input="My name is Zorblax.", temperature=0,
                                    max_output_tokens=20)
    second = client.responses.create(model=MODEL, input="What is my name?", temperature=0,
                                     max_output_tokens=20, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # the earlier turn is in the prompt: it is longer than the question alone by both turns
    alone = client.responses.create(model=MODEL, input="What is my name?", temperature=0,
                                    max_output_tokens=20, store=False)
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"


BAD = [
    ({"input": [{"type": "message", "role": "wizard", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c1"}]}, "input.0.output"),
    ({"input": [{"type": "function_call_output", "call_id": "nowhere", "output": "1"}]},
     "input.0.call_id"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": "hi", "colour": 1}]}, "input.0.colour"),
    ({"input": []}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools.0.type"),
    ({"input": "hi", "tools": [{"type": "teleport"}]}, "tools.0.type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
    ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "s",
                                         "schema": {"type": "object", "properties": {
                                             "a": {"type": "integer", "minimum": 5,
                                                   "maximum": 1}}}}}}, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "x " * 300_000}, "input"),
    ({"input": [{"role": "user", "content": "x"}] * 3000}, "input"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server.base_url}/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_bad_input_leaves_nothing_running(server):
    for body, _ in BAD[:6]:
        httpx.post(f"{server.base_url}/v1/responses", json={"model": MODEL, **body}, timeout=60)
    deadline = time.monotonic() + 30
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(f"{server.base_url}/metrics").text
        if 'tokenmill:num_requests_running{model_name="smollm2-135m"} 0.0' in text and \
                'tokenmill:kv_cache_usage_perc{model_name="smollm2-135m"} 0.0' in text:
            return
        time.sleep(0.2)
    raise AssertionError(text)


def test_store_evicts_the_least_recently_used(reasoning_server):  # a store of two
    client = openai.OpenAI(base_url=f"{reasoning_server.base_url}/v1", api_key="x",
                           max_retries=0)
    ids = [client.responses.create(model=MODEL, input=f"Count to {i}.", temperature=0,
                                   max_output_tokens=3).id for i in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[1]).id == ids[1]  # now the most recent
    client.responses.create(model=MODEL, input="Count to 9.", max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[2])
    assert client.responses.retrieve(ids[1]).id == ids[1]
    with pytest.raises(openai.BadRequestError):  # evicted: nothing to continue from
        client.responses.create(model=MODEL, input="hi", previous_response_id=ids[0])


def test_openai_agents_sdk_runs_a_tool_using_turn(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.",
                         tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required",
                                                             temperature=0, max_tokens=60),
                         tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?")
    assert len(calls) == 1
    assert result.final_output == f"Sunny in {calls[0]}"
