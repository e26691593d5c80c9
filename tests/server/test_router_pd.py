"""Issue 62 end to end: a prefill and a decode `tokenmill serve` behind vllm-router's
--vllm-pd-disaggregation (the PyPI wheel, unchanged). Output through the router equals
the decode instance's own (one instance prefilling and decoding), every prompt token's
KV arrived by transfer and none fell back; the prefill instance's pins are freed."""


import httpx
import pytest

from benchmarks.server import router_binary, running_router
from tests.serving import free_port, start_server, wait_until

pytestmark = pytest.mark.slow

ROUTER = router_binary()
MODEL = "smollm2-135m"
PROMPTS = ["The capital of France is", "List three prime numbers and say why they are prime:",
           "Once upon a time, in a quiet village by the river, there lived"]


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(f"tokenmill:{name}"))


@pytest.fixture(scope="module")
def pd():
    if ROUTER is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router==0.1.17)")
    common = ["--max-num-seqs", "4", "--kv-cache-memory", "64MiB"]
    prefill = start_server(MODEL, *common, "--kv-transfer-config", '{"kv_role": "kv_producer"}')
    decode = start_server(MODEL, *common, "--kv-transfer-config", '{"kv_role": "kv_consumer"}')
    args = ["--vllm-pd-disaggregation", "--prefill", prefill.base_url,
            "--decode", decode.base_url, "--policy", "round_robin"]
    try:
        with running_router(args, log_path=f"/tmp/vllm-router-pd-{free_port()}.log") as url:
            yield url, prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def _complete(base_url: str, prompt: str, stream: bool = False) -> tuple[str, int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "stream": stream}
    if not stream:
        r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert "kv_transfer_params" not in out  # only a prefill's reply carries it
        return out["choices"][0]["text"], out["usage"]["prompt_tokens"]
    text = ""
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json

                text += json.loads(line[6:])["choices"][0]["text"]
    return text, 0


def test_pd_through_vllm_router_equals_one_instance(pd):
    router, prefill, decode = pd
    reference = [_complete(decode.base_url, p)[0] for p in PROMPTS]  # one instance, no PD
    received = _metric(decode.base_url, "kv_transfer_received_tokens_total")
    got, prompt_tokens = zip(*(_complete(router, p) for p in PROMPTS))
    assert list(got) == reference
    streamed = _complete(router, PROMPTS[0], stream=True)[0]
    assert streamed == reference[0]
    chat_body = {"model": MODEL, "max_tokens": 8, "temperature": 0,
                 "messages": [{"role": "user", "content": "Say hello."}]}
    # the reference first: afterwards the pulled blocks sit in the decode instance's
    # prefix cache, and a hit computes the prompt's tail in another batch shape
    chat_ref = httpx.post(f"{decode.base_url}/v1/chat/completions", timeout=120,
                          json=chat_body).json()
    chat = httpx.post(f"{router}/v1/chat/completions", timeout=120, json=chat_body)
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"] == chat_ref["choices"][0]["message"]
    pulled = _metric(decode.base_url, "kv_transfer_received_tokens_total") - received
    assert pulled == sum(prompt_tokens) + prompt_tokens[0] + chat_ref["usage"]["prompt_tokens"]
    assert _metric(decode.base_url, "kv_transfer_fallback_total") == 0
    # every pin was pulled and freed: nothing holds a block on the prefill instance
    assert wait_until(lambda: _metric(prefill.base_url, "kv_cache_usage_perc") == 0, 10)


def test_a_prefill_request_answers_where_its_kv_is(pd):
    _, prefill, decode = pd
    r = httpx.post(f"{prefill.base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "hello there", "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    # the decode instance refuses to be a prefill one, naming the field
    bad = httpx.post(f"{decode.base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "hello", "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "kv_transfer_params"
