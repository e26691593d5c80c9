"""What real clients send must not be refused: tests/data/client_requests.json
(made by tests/data/capture_client_requests.py and, for `vllm bench serve`,
tests/data/capture_vllm_bench_requests.py) replayed, and unknown fields
refused by name."""

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


@pytest.mark.parametrize("entry", BODIES, ids=IDS)
def test_client_body_validates(entry):
    MODELS[entry["path"]].model_validate(entry["body"])


@pytest.mark.parametrize("entry", BODIES, ids=IDS)
def test_client_body_is_served(server, entry):
    r = httpx.post(server.base_url + entry["path"], json=entry["body"], timeout=120)
    if r.status_code == 400 and r.json()["error"]["param"] == entry.get("needs"):
        pytest.xfail(f"{entry['needs']} is another branch's feature")
    assert r.status_code == 200, r.text
    if entry["body"].get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]")


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
