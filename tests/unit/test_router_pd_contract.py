"""Issue 62: what vllm-router 0.1.17's --vllm-pd-disaggregation sends, as recorded by
tests/data/capture_router_requests.py, and tokenmill's request models taking it."""

import json
from pathlib import Path

import pytest

from tokenmill.server import protocol as p

DATA = json.loads((Path(__file__).resolve().parents[1] / "data" /
                   "router_pd_requests.json").read_text())
MODELS = {"/v1/completions": p.CompletionRequest, "/v1/chat/completions": p.ChatCompletionRequest}


@pytest.mark.parametrize("entry", DATA["prefill"], ids=lambda e: e["path"])
def test_the_prefill_request_asks_one_token_and_a_remote_decode(entry):
    body = entry["body"]
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    assert entry["headers"]["x-request-id"].startswith("___prefill_addr_")
    params = MODELS[entry["path"]].model_validate(body).to_sampling_params()
    assert params.max_tokens == 1
    assert params.kv_transfer_params == body["kv_transfer_params"]


@pytest.mark.parametrize("entry", DATA["decode"], ids=lambda e: e["path"])
def test_the_decode_request_carries_the_prefill_reply_verbatim(entry):
    body = entry["body"]
    assert body["kv_transfer_params"] == DATA["planted_kv_transfer_params"]
    params = MODELS[entry["path"]].model_validate(body).to_sampling_params()
    assert params.kv_transfer_params == DATA["planted_kv_transfer_params"]


def test_a_streamed_prefill_is_refused():
    with pytest.raises(ValueError, match="do_remote_decode needs stream false"):
        p.CompletionRequest.model_validate({"prompt": "x", "max_tokens": 1, "stream": True,
                                            "kv_transfer_params": {"do_remote_decode": True}})
