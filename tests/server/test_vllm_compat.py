"""A vLLM launch line works unchanged: vLLM's flag names with vLLM's meanings,
VLLM_API_KEY, vLLM's metric names, and the chat-template options."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.serving import start_server

pytestmark = pytest.mark.slow

KEY = "vllm-key"
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}{% if m.name %}:{{ m.name }}{% endif %}>"
    "{{ m['content'] }}{% if not (loop.last and continue_final_message) %}</s>{% endif %}"
    "{% endfor %}"
    "{% if documents %}[docs:{% for d in documents %}{{ d['title'] }};{% endfor %}]{% endif %}"
    "{% if greeting %}[{{ greeting }}]{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-flags")
    (d / "template.jinja").write_text(TEMPLATE)
    (d / "gen").mkdir()
    (d / "gen" / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    srv = start_server(
        "smollm2-135m", "--served-model-name", "served-a", "served-b",
        "--gpu-memory-utilization", "0.02", "--max-model-len", "2048",
        "--no-enable-chunked-prefill", "--no-enable-prefix-caching", "--disable-log-requests",
        "--uvicorn-log-level", "warning", "--trust-remote-code", "--metrics-prefix", "vllm",
        "--enable-prompt-tokens-details", "--generation-config", str(d / "gen"),
        "--chat-template", str(d / "template.jinja"),
        "--chat-template-content-format", "string", env={"VLLM_API_KEY": KEY})
    yield srv
    srv.stop()


def _post(srv, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{srv.base_url}{path}", json=body, headers=headers, timeout=120)


def _render(srv, body: dict) -> str:
    ids = _post(srv, "/tokenize", body).json()["tokens"]
    return _post(srv, "/detokenize", {"tokens": ids}).json()["prompt"]


def test_vllm_api_key_and_served_names(vllm_server):
    assert _post(vllm_server, "/v1/completions", {"prompt": "x"}, key=None).status_code == 401
    models = httpx.get(f"{vllm_server.base_url}/v1/models",
                       headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in models["data"]] == ["served-a", "served-b"]
    assert models["data"][0]["max_model_len"] == 2048
    r = _post(vllm_server, "/v1/completions", {"model": "served-b", "prompt": "Hi",
                                               "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "served-a"


def test_generation_config_sets_unset_sampling_defaults(vllm_server):
    client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key=KEY, max_retries=0)
    body = {"model": "served-a", "prompt": "Once upon a time", "max_tokens": 12}
    # temperature 0 from generation_config.json: unseeded runs agree with greedy
    runs = {client.completions.create(**body).choices[0].text for _ in range(3)}
    greedy = client.completions.create(**body, temperature=0).choices[0].text
    assert runs == {greedy}


def test_vllm_metric_names_parse(vllm_server):
    from prometheus_client.parser import text_string_to_metric_families

    _post(vllm_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    text = httpx.get(f"{vllm_server.base_url}/metrics").text
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count"]:
        assert name in names, name
    assert not any(n.startswith("tokenmill:") for n in names)


def test_chat_template_file_kwargs_documents_and_names(vllm_server):
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "name": "ann",
                          "content": [{"type": "text", "text": "one"},
                                      {"type": "text", "text": "two"}]}],
            "chat_template_kwargs": {"greeting": "HELLO"},
            "documents": [{"title": "doc1", "text": "x"}]}
    text = _render(vllm_server, body)
    assert text == ("<system>Be brief.</s><user:ann>one\ntwo</s>[docs:doc1;][HELLO]"
                    "<assistant>")
    r = _post(vllm_server, "/v1/chat/completions", {**body, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == _post(
        vllm_server, "/tokenize", body).json()["count"]


def test_continue_final_message_leaves_the_assistant_turn_open(vllm_server):
    body = {"messages": [{"role": "user", "content": "Count"},
                         {"role": "assistant", "content": "1 2 3"}],
            "continue_final_message": True, "add_generation_prompt": False}
    assert _render(vllm_server, body) == "<user>Count</s><assistant>1 2 3"
    r = _post(vllm_server, "/v1/chat/completions", {**body, "max_tokens": 3})
    assert r.status_code == 200, r.text
    bad = _post(vllm_server, "/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert bad.status_code == 400
    bad = _post(vllm_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
        "add_generation_prompt": False})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_unchunked_prefill_serves_a_prompt_longer_than_the_default_step(vllm_server):
    prompt = "word " * 1500  # > 1024 tokens: one step must take it whole
    r = _post(vllm_server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 1024
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_trust_remote_code_checkpoint_is_refused_clearly(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["MyCustomForCausalLM"], "auto_map": {"AutoModelForCausalLM": "x.y"}}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(RuntimeError, match="does not run checkpoint code"):
        start_server(str(tmp_path), "--trust-remote-code", ready_timeout_s=60)
