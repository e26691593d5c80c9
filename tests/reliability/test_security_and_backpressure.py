"""One server with several API keys (flags and VLLM_API_KEY), --metrics-auth, a
chat template that reaches for `__class__`, a small --max-stream-backlog and a
prefaulted KV pool: who gets in, what the log never shows, what a client that
stops reading costs, and what an operator reads about memory."""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest

from tests.reliability.common import metric, wait_idle
from tests.serving import start_server
from tokenmill.cli.serve import api_keys_of

pytestmark = pytest.mark.slow

KEYS = ("key-one", "key-two", "key-from-env")
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
BACKLOG = 8
SECRET = "zebra-violet-7731"  # a prompt marker that must never reach the log
ESCAPING_TEMPLATE = ("{% for m in messages %}{{ m.content.__class__.__mro__[1]"
                     ".__subclasses__() }}{% endfor %}")


@pytest.fixture(scope="module")
def guarded(tiny_model, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "escape.jinja"
    template.write_text(ESCAPING_TEMPLATE)
    srv = start_server(tiny_model, "--api-key", KEYS[0], "--api-key", KEYS[1],
                       "--metrics-auth", "--chat-template", str(template),
                       "--max-stream-backlog", str(BACKLOG), "--kv-cache-memory", "64MiB",
                       "--kv-cache-prefault", "--max-num-seqs", "64",
                       env={"VLLM_API_KEY": KEYS[2], "TOKENMILL_API_KEY": ""})
    yield srv
    srv.stop()


def test_api_keys_from_flags_and_environment():
    env = {"TOKENMILL_API_KEY": "b", "VLLM_API_KEY": "c"}
    assert api_keys_of(["a", "b"], env) == ["a", "b", "c"]
    assert api_keys_of(None, {}) == []


def test_every_key_gets_in_and_no_other(guarded):
    body = {"prompt": f"hello {SECRET}", "max_tokens": 2}
    for key in KEYS:
        r = httpx.post(f"{guarded.base_url}/v1/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, (key, r.text)
        assert SECRET not in r.json()["id"]
    for headers in ({}, {"Authorization": "Bearer key-on"}, {"Authorization": KEYS[0]}):
        r = httpx.post(f"{guarded.base_url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_metrics_need_a_key_with_metrics_auth(guarded):
    assert httpx.get(f"{guarded.base_url}/metrics").status_code == 401
    assert httpx.get(f"{guarded.base_url}/metrics", headers=AUTH).status_code == 200
    assert httpx.get(f"{guarded.base_url}/health").status_code == 200  # probes stay open


def test_a_template_reaching_for_class_fails_cleanly(guarded):
    r = httpx.post(f"{guarded.base_url}/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"messages": [{"role": "user", "content": SECRET}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "chat template" in error["message"] and error["param"] == "messages"
    assert "subclasses" not in r.text or "unsafe" in r.text.lower()


def test_a_client_that_stops_reading_is_aborted_and_frees_its_blocks(guarded):
    generated_before = metric(guarded.base_url, ":generation_tokens_total", AUTH) \
        if _has(guarded, ":generation_tokens_total") else None
    body = (b'{"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true, '
            b'"stream": true, "n": 64, "logprobs": 20}')  # 64 chunks of ~1 KB a step
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
               b"\r\nAuthorization: Bearer " + KEYS[1].encode() + b"\r\nContent-Length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
    sock = socket.socket()
    # the server's kernel send buffer still grows to 4 MiB (tcp_wmem) and uvicorn
    # holds 64 KiB more: ~64 KB a step fills them in under a hundred steps
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", guarded.port))
    try:
        sock.sendall(request)
        time.sleep(1.0)  # it is generating; we read nothing
        wait_idle(guarded.base_url, timeout_s=90, headers=AUTH)  # aborted: blocks back
        assert httpx.get(f"{guarded.base_url}/health").status_code == 200
        if generated_before is not None:  # it stopped well before its 64 x 400 tokens
            generated = metric(guarded.base_url, ":generation_tokens_total", AUTH)
            assert generated - generated_before < 64 * 300
        sock.settimeout(30)
        received = b""
        while b"data: [DONE]" not in received:  # now read: the stream ends with the reason
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    finally:
        sock.close()
    assert b"stream_too_slow" in received, received[-500:]
    assert b"data: [DONE]" in received


def test_memory_an_operator_can_read(guarded):
    log = guarded.log()
    m = re.search(r"expected steady-state RSS (\d+) MiB = baseline (\d+) MiB \+ weights "
                  r"(\d+) MiB \+ runtime (\d+) MiB \+ KV pool (\d+) MiB \(now (\d+) MiB", log)
    assert m, log[-2000:]
    total, baseline, weights, runtime, kv, now = map(int, m.groups())
    assert abs(total - (baseline + weights + runtime + kv)) <= 2 and 60 <= kv <= 66
    # measured: with the pool prefaulted, the figure is what the process holds at start
    assert abs(total - now) <= 3 and weights > 0
    pool = metric(guarded.base_url, ":kv_cache_pool_bytes", AUTH)
    committed = metric(guarded.base_url, ":kv_cache_committed_bytes", AUTH)
    assert committed == pool > 0  # --kv-cache-prefault touched it all
    assert metric(guarded.base_url, "process_resident_memory_bytes", AUTH) > pool


def test_the_log_never_holds_prompt_text(guarded):
    """Runs after the others in this module: every request above carried SECRET."""
    assert SECRET not in guarded.log()


def _has(srv, suffix: str) -> bool:
    try:
        metric(srv.base_url, suffix, AUTH)
        return True
    except AssertionError:
        return False
