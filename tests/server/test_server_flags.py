"""Server flags docs/serving.md documents, on a server of their own: --served-model-name,
--max-request-size, and the API key from TOKENMILL_API_KEY."""

import httpx
import pytest

from tests.serving import start_server

pytestmark = pytest.mark.slow

KEY = "env-key-123"


@pytest.fixture(scope="module")
def flagged_server():
    srv = start_server("smollm2-135m", "--served-model-name", "my-model",
                       "--max-request-size", "2KiB", env={"TOKENMILL_API_KEY": KEY})
    yield srv
    srv.stop()


def _post(srv, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{srv.base_url}/v1/completions", json=body, headers=headers,
                      timeout=120)


def test_served_model_name_is_the_name_clients_send(flagged_server):
    models = httpx.get(f"{flagged_server.base_url}/v1/models",
                       headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in models["data"]] == ["my-model"]
    r = _post(flagged_server, {"model": "my-model", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "my-model"
    r = _post(flagged_server, {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert 'model_name="my-model"' in httpx.get(f"{flagged_server.base_url}/metrics").text


def test_api_key_from_the_environment(flagged_server):
    assert _post(flagged_server, {"prompt": "Hi", "max_tokens": 2}, key=None).status_code == 401
    assert _post(flagged_server, {"prompt": "Hi", "max_tokens": 2}, key="nope").status_code == 401
    assert _post(flagged_server, {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_max_request_size(flagged_server):
    small = _post(flagged_server, {"prompt": "x" * 1500, "max_tokens": 1})
    assert small.status_code == 200
    big = _post(flagged_server, {"prompt": "x" * 2100, "max_tokens": 1})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
