"""What real clients send must not be refused: tests/data/client_requests.json
(made by tests/data/capture_*requests*.py: the openai SDK and lm-eval, the
frameworks, `vllm bench serve`, vllm-router) replayed, and unknown fields refused by
name.

A body with tools and no tool_choice asks for "auto", which tokenmill (as vLLM)
serves only with --enable-auto-tool-choice --tool-call-parser: such bodies
(langchain's bind_tools default) are replayed on a server started so."""

import json
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from tokenmill.server import protocol as p
from tokenmill.server.errors import validation_error

BODIES = json.loads((Path(__file__).parents[1] / "data" / "client_requests.json").read_text())
IDS = [f"{i}-{b['client']}" for i, b in enumerate(BODIES)]
MODELS = {"/v1/completions": p.CompletionRequest, "/v1/chat/completions": p.ChatCompletionRequest,
          "/tokenize": p.TokenizeRequest}
AUTO_TOOLS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def _wants_auto_tools(body: dict) -> bool:
    return bool(body.get("tools")) and body.get("tool_choice") in (None, "auto")


@pytest.fixture(scope="module")
def auto_tool_server():
    from tests.serving import start_server

    srv = start_server("smollm2-135m", "--max-num-seqs", "8", *AUTO_TOOLS)
    yield srv
    srv.stop()


@pytest.mark.parametrize("entry", BODIES, ids=IDS)
def test_client_body_validates(entry):
    MODELS[entry["path"]].model_validate(entry["body"])


@pytest.mark.parametrize("entry", BODIES, ids=IDS)
def test_client_body_is_served(request, entry):
    body = entry["body"]
    server = request.getfixturevalue("auto_tool_server" if _wants_auto_tools(body) else "server")
    r = httpx.post(server.base_url + entry["path"], json=body, timeout=120)
    if r.status_code == 400 and r.json()["error"]["param"] == entry.get("needs"):
        pytest.xfail(f"{entry['needs']} is another branch's feature")
    assert r.status_code == 200, r.text
    if body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
        _tool_deltas_as_openai(r.text)
        return
    if entry["path"] == "/tokenize":
        assert r.json()["tokens"], r.text
        return
    choice = r.json()["choices"][0]
    named = body.get("tool_choice")
    if isinstance(named, dict):  # what the client will read: a call of that function
        calls = choice["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == [named["function"]["name"]], choice
    fmt = (body.get("response_format") or {}).get("type")
    if fmt in ("json_object", "json_schema") and choice["finish_reason"] == "stop":
        json.loads(choice["message"]["content"])


def _tool_deltas_as_openai(sse: str) -> None:
    """Each chunk has at most one delta per call, and a call's first one carries its
    id and name: langchain and instructor merge deltas by index across chunks."""
    opened = set()
    for line in sse.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            deltas = (choice.get("delta") or {}).get("tool_calls") or []
            indexes = [d["index"] for d in deltas]
            assert len(indexes) == len(set(indexes)), deltas
            for d in deltas:
                if d["index"] not in opened:
                    assert d["id"] and d["function"]["name"], d
                    opened.add(d["index"])


def test_auto_tool_bodies_need_the_flags(server):
    body = next(e["body"] for e in BODIES if _wants_auto_tools(e["body"]))
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]


def _error(model, body):
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return validation_error(e.value.errors())


def test_unknown_fields_are_named_nested_too():
    err = _error(p.CompletionRequest, {"prompt": "x", "frobnicate": 1})
    assert (err.status, err.param) == (400, "frobnicate")
    assert err.message == "Unrecognized request argument supplied: frobnicate"
    err = _error(p.ChatCompletionRequest, {"messages": [{"role": "user", "content": "x",
                                                         "colour": "red"}]})
    assert err.param == "messages.0.colour"
    err = _error(p.ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                           "stream": True, "stream_options": {"bogus": True}})
    assert err.param == "stream_options.bogus"


def test_nulls_and_no_op_metadata_are_accepted():
    req = p.ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "n": None, "stream": None,
        "reasoning_effort": None, "store": True, "metadata": {"a": "b"}, "service_tier": "auto"})
    assert req.n == 1 and req.stream is False


def test_lenient_mode_drops_unknown_fields():
    p.allow_unknown_fields(True)
    try:
        req = p.CompletionRequest.model_validate({"prompt": "x", "frobnicate": 1})
    finally:
        p.allow_unknown_fields(False)
    assert req.prompt == "x"
    _error(p.CompletionRequest, {"prompt": "x", "frobnicate": 1})


def test_best_of_above_one_is_refused():
    with pytest.raises(ValueError, match="best_of"):
        p.CompletionRequest(prompt="x", best_of=2).to_sampling_params()


def test_the_routers_sglang_fields_do_what_they_say():
    # vllm-router forwards every request with these (tests/data/capture_router_requests.py)
    req = p.CompletionRequest.model_validate({"prompt": "x", "stop": ["."], "no_stop_trim": True})
    assert req.to_sampling_params().include_stop_str_in_output
    req = p.CompletionRequest.model_validate({"prompt": "x", "stop": ["."], "no_stop_trim": False})
    assert not req.to_sampling_params().include_stop_str_in_output
    err = _error(p.CompletionRequest, {"prompt": "x", "return_hidden_states": True})
    assert (err.status, err.param) == (400, "return_hidden_states")
