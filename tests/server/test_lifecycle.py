"""A server of its own: API key, a bounded waiting queue (503 + Retry-After), and
SIGTERM that lets in-flight requests finish and exits 0."""

import concurrent.futures
import signal
import threading
import time

import httpx
import pytest

from tests.serving import start_server

pytestmark = pytest.mark.slow

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def small_server():
    # a long shutdown timeout: the drain test's 200 tokens must finish on a busy machine
    srv = start_server("smollm2-135m", "--api-key", KEY, "--max-num-seqs", "1",
                       "--max-waiting", "1", "--shutdown-timeout", "600")
    yield srv
    srv.stop()


def _complete(srv, key: str | None = KEY, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{srv.base_url}/v1/completions", headers=headers, timeout=120,
                      json={"prompt": "Once upon a time", "max_tokens": 2, **body})


def test_api_key_required_on_api_routes_only(small_server):
    for key in (None, "wrong", KEY + "x"):
        r = _complete(small_server, key)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{small_server.base_url}/v1/models").status_code == 401
    assert _complete(small_server).status_code == 200
    assert httpx.get(f"{small_server.base_url}/health").status_code == 200


def test_full_waiting_queue_gets_503_with_retry_after(small_server):
    # one runs, one waits, the rest are refused until a slot frees up
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(
            lambda _: _complete(small_server, max_tokens=24, ignore_eos=True), range(6)))
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 2 and 503 in codes, codes
    refused = next(r for r in responses if r.status_code == 503)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "service_unavailable_error"
    assert _complete(small_server).status_code == 200  # serving again once drained


def _stream_lines(srv, max_tokens: int, first: threading.Event, lines: list[str]) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=600,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if line.startswith('data: {"id"'):
                    first.set()
    except httpx.HTTPError as e:  # the server closed the stream
        lines.append(f"error: {type(e).__name__}")
    finally:
        first.set()


def _refused(srv) -> bool:
    try:
        httpx.get(f"{srv.base_url}/health", timeout=5)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        pass
    return False


def _events(lines: list[str]) -> list[dict]:
    import json

    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_sigterm_drains_a_long_stream_refuses_new_connections_and_exits_0(small_server):
    # 200 tokens streaming when the signal lands: all of them still arrive
    first, lines = threading.Event(), []
    reader = threading.Thread(target=_stream_lines, args=(small_server, 200, first, lines))
    reader.start()
    assert first.wait(120)
    small_server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not _refused(small_server) and time.monotonic() < deadline:
        time.sleep(0.05)
    refused_while_streaming = reader.is_alive()
    assert _refused(small_server), "still accepting connections after SIGTERM"
    reader.join(600)
    assert small_server.proc.wait(60) == 0
    assert refused_while_streaming, "the stream ended before new connections were refused"
    events = _events(lines)
    assert lines[-1] == "data: [DONE]"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 200


@pytest.mark.parametrize("layout", [[], ["--engine-in-process"]], ids=["core", "in-process"])
def test_sigterm_past_the_shutdown_timeout_aborts_what_is_left(layout):
    srv = start_server("smollm2-135m", "--shutdown-timeout", "4", "--api-key", KEY, *layout)
    try:
        first, lines = threading.Event(), []
        reader = threading.Thread(target=_stream_lines, args=(srv, 5000, first, lines))
        reader.start()
        assert first.wait(120)
        srv.proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert not reader.is_alive()
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()
    events = _events(lines)
    tokens = sum(1 for e in events if e.get("choices"))
    assert 1 <= tokens < 5000
    assert not any(e.get("choices") and e["choices"][0]["finish_reason"] for e in events)
    # an OpenAI error event, code "aborted", before uvicorn closes the connection at
    # --shutdown-timeout (the server aborts what is left just before)
    errors = [e["error"] for e in events if "error" in e]
    assert errors, f"stream cut without the 'aborted' event: {lines[-3:]}"
    assert errors[-1]["code"] == "aborted", lines[-3:]


def test_port_in_use_exits_1_instead_of_serving_nothing():
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "tokenmill.cli", "serve", "smollm2-135m",
             "--host", "127.0.0.1", "--port", str(port)],
            check=False, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1
    assert "address already in use" in (proc.stdout + proc.stderr).lower()
