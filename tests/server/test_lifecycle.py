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
    srv = start_server("smollm2-135m", "--api-key", KEY, "--max-num-seqs", "1",
                       "--max-waiting", "1")
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


def test_sigterm_finishes_in_flight_and_exits_0(small_server):
    result = {}

    def in_flight():
        result["response"] = _complete(small_server, max_tokens=16, ignore_eos=True)

    worker = threading.Thread(target=in_flight)
    worker.start()
    time.sleep(1.0)  # the request is running
    small_server.proc.send_signal(signal.SIGTERM)
    assert small_server.proc.wait(60) == 0
    worker.join(10)
    r = result["response"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


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
