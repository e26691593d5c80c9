"""The ASGI gate in front of the app: API key, then the request-size limit."""

from __future__ import annotations

import hmac
import json
import time
from typing import Any

from tokenmill.server.errors import APIError, error_body

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


class Gate:
    """Pure ASGI, before routing: API key on /v1 and tokenize routes (and on
    /metrics with `metrics_auth`), then the request-size limit (the body is read
    here once and replayed to the app)."""

    PROTECTED = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app: Any, api_key: str | list[str] | None, max_request_bytes: int,
                 metrics_auth: bool = False) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self.api_keys = [k.encode() for k in keys if k]
        self.protected = self.PROTECTED + (("/metrics",) if metrics_auth else ())
        self.max_request_bytes = max_request_bytes

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        # every key compared, so the time taken does not tell which one nearly matched
        return sum(hmac.compare_digest(token, key) for key in self.api_keys) > 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # when the request arrived (request.state.arrival_time): TTFT, queue and E2E
        # count from here, before the body is read and parsed, as the client counts
        scope.setdefault("state", {})["arrival_time"] = time.monotonic()
        headers = dict(scope.get("headers") or [])
        if self.api_keys and scope["path"].startswith(self.protected) \
                and not self._authorized(headers):
            return await _send_error(send, APIError(
                401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                code="invalid_api_key", headers={"www-authenticate": "Bearer"}))
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            return await _send_error(send, self._too_large())
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        body = await self._read_body(receive)
        if body is None:
            return  # client left before sending its body
        if isinstance(body, APIError):
            return await _send_error(send, body)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Any) -> bytes | APIError | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                return self._too_large()
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_request_bytes} bytes",
                        code="request_too_large")


async def _send_error(send: Any, err: APIError) -> None:
    body = json.dumps(error_body(err.message, err.type, err.param, err.code)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
