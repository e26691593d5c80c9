"""Request validation and error mapping, without a model: what a client sees
for a bad field is decided here."""

import json

import pytest
from pydantic import ValidationError

from tokenmill.server import protocol as p
from tokenmill.server.errors import validation_error
from tokenmill.server.metrics import ServerMetrics


def _error_for(model, body: dict):
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return validation_error(e.value.errors())


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0),
    ("logprobs", 21), ("presence_penalty", 3.0), ("seed", 2**70), ("min_p", 1.5),
    ("max_tokens", "many"), ("stop_token_ids", [-1]),
])
def test_out_of_bounds_field_is_a_400_naming_the_param(field, value):
    err = _error_for(p.CompletionRequest, {"prompt": "hi", field: value})
    assert err.status == 400
    assert err.param.split(".")[0] == field
    assert err.message.startswith(field)


def test_nan_temperature_is_rejected():
    body = json.loads('{"prompt": "hi", "temperature": NaN}')  # Python's json accepts NaN
    assert _error_for(p.CompletionRequest, body).param == "temperature"


def test_stream_options_without_stream_and_top_logprobs_without_logprobs():
    err = _error_for(p.CompletionRequest, {"prompt": "x",
                                           "stream_options": {"include_usage": True}})
    assert "stream_options" in err.message
    err = _error_for(p.ChatCompletionRequest, {
        "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert "top_logprobs" in err.message


def test_union_type_errors_name_the_field():
    err = _error_for(p.CompletionRequest, {"prompt": 3})
    assert err.param == "prompt" and err.message.startswith("prompt: ")
    err = _error_for(p.ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]})
    assert err.param == "messages.0.content"


def test_chat_needs_messages_and_known_roles():
    assert _error_for(p.ChatCompletionRequest, {"messages": []}).param == "messages"
    err = _error_for(p.ChatCompletionRequest, {"messages": [{"role": "wizard", "content": "x"}]})
    assert err.param.startswith("messages.0.role")


def test_malformed_json_error():
    err = validation_error([{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error",
                             "ctx": {"error": "Expecting value"}}])
    assert err.status == 400 and err.code == "invalid_json"
    assert "not valid JSON" in err.message


def test_default_max_tokens_completions_16_chat_up_to_context():
    assert p.CompletionRequest(prompt="x").to_sampling_params().max_tokens == 16
    chat = p.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert chat.to_sampling_params().max_tokens is None
    chat = p.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                   max_completion_tokens=7, max_tokens=3)
    assert chat.to_sampling_params().max_tokens == 7


def test_vllm_extras_reach_sampling_params():
    req = p.CompletionRequest(prompt="x", top_k=5, min_p=0.1, repetition_penalty=1.2,
                              ignore_eos=True, min_tokens=2, stop_token_ids=[7], stop="##",
                              temperature=0, seed=3, logprobs=2)
    sp = req.to_sampling_params()
    assert (sp.top_k, sp.min_p, sp.repetition_penalty, sp.ignore_eos, sp.min_tokens) == \
        (5, 0.1, 1.2, True, 2)
    assert sp.stop_token_ids == [7] and sp.stop == ["##"] and sp.seed == 3 and sp.logprobs == 2
    chat = p.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                   logprobs=True, top_logprobs=3)
    assert chat.to_sampling_params().logprobs == 3


def test_sampling_params_errors_keep_their_param():
    req = p.CompletionRequest(prompt="x", max_tokens=2, min_tokens=5)
    with pytest.raises(ValueError) as e:
        req.to_sampling_params()
    assert e.value.param == "min_tokens"


def test_metrics_use_vllm_names_with_tokenmill_prefix():
    from tokenmill.engine.core.stats import EngineStats

    stats = EngineStats(num_running=1, num_waiting=2, kv_cache_usage=0.25,
                        prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=0,
                        prompt_tokens=30, generation_tokens=40, spec_proposed_tokens=8,
                        spec_accepted_tokens=6, spec_verified_steps=2)
    text = ServerMetrics(lambda: stats, "m").render().decode()
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "request_prefill_time_seconds_bucket",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "spec_decode_num_drafts_total"]:
        assert f"tokenmill:{name}" in text, name
    assert 'tokenmill:kv_cache_usage_perc{model_name="m"} 0.25' in text
    assert 'tokenmill:spec_decode_draft_acceptance_rate{model_name="m"} 0.75' in text
    assert 'tokenmill:spec_decode_mean_accepted_length{model_name="m"} 4.0' in text
    assert 'tokenmill:request_success_total{finished_reason="length",model_name="m"} 0.0' in text


def test_vllm_metrics_prefix_parses_with_vllm_names_and_labels():
    """What vLLM's dashboards and llm-d's endpoint picker read, via prometheus_client's
    own text parser (a scraper's view, not a substring match)."""
    from prometheus_client.parser import text_string_to_metric_families

    from tokenmill.engine.core.stats import EngineStats

    stats = EngineStats(num_running=3, num_waiting=5, kv_cache_usage=0.5)
    metrics = ServerMetrics(lambda: stats, "m", prefix="vllm")
    metrics.observe_gap(0.02)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    samples = {(s.name, s.labels.get("finished_reason", "")): s
               for f in families.values() for s in f.samples}
    for name, value in [("vllm:num_requests_running", 3), ("vllm:num_requests_waiting", 5),
                        ("vllm:kv_cache_usage_perc", 0.5)]:
        assert samples[(name, "")].value == value
        assert samples[(name, "")].labels == {"model_name": "m", "engine": "0"}
    assert samples[("vllm:inter_token_latency_seconds_count", "")].value == 1
    assert ("vllm:request_success_total", "stop") in samples
    assert not any(name.startswith("tokenmill:") for name in families)
    with pytest.raises(ValueError, match="prefix"):
        ServerMetrics(lambda: stats, "m", prefix="sglang")
