"""FastAPI routes of the OpenAI-compatible server: completions, chat (both
streamed as SSE), models, tokenize, health, metrics; OpenAI error objects for
every failure, an API-key gate and a request-size limit.

The engine itself lives behind `AsyncEngine`; this module turns HTTP into
(prompt, SamplingParams) and RequestOutputs back into OpenAI JSON.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill import __version__
from tokenmill.engine.async_engine import (
    AsyncEngine,
    EngineStepError,
    EngineUnavailableError,
    QueueFullError,
    RequestStream,
)
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server import protocol as p
from tokenmill.server.metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
_MIN_LOGPROB = -9999.0  # JSON has no -inf


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code),
                        status_code=err.status, headers=err.headers)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """FastAPI's validation errors (bad JSON, wrong types, out of bounds) as one 400."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({reason})".replace(" ()", ""),
                        code="invalid_json")
    loc = []
    for part in first.get("loc", ()):
        if part == "body" and not loc:
            continue
        if isinstance(part, str) and _is_union_tag(part):
            break  # the rest names a branch of a union type, not a field
        loc.append(str(part))
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing" and not loc:
        return APIError(400, "the request body is missing or not a JSON object")
    if param:
        msg = f"{param}: {msg}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problems)"
    return APIError(400, msg, param=param)


def _is_union_tag(part: str) -> bool:
    # pydantic names union branches by type: 'str', 'list[int]', 'TextPart', ...
    return "[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper()


class _Gate:
    """Pure ASGI, before routing: API key on /v1 and tokenize routes, then the
    request-size limit (the body is read here once and replayed to the app)."""

    PROTECTED = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app: Any, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"].startswith(self.PROTECTED):
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.api_key):
                return await _send_error(send, APIError(
                    401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                    code="invalid_api_key", headers={"www-authenticate": "Bearer"}))
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            return await _send_error(send, self._too_large())
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        body, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                return await _send_error(send, self._too_large())
            body.append(chunk)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

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


def _check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param} is not valid Unicode text (lone surrogate)",
                       param=param) from None


class _Progress:
    """What has been sent of each choice, to turn cumulative outputs into deltas."""

    def __init__(self, n: int, metrics: ServerMetrics, object_name: str) -> None:
        self.object = object_name  # of the stream's chunks
        self.created = int(time.time())
        self.text_len = [0] * n
        self.num_tokens = [0] * n
        self.finish_sent = [False] * n
        self.chunk_sent = [False] * n
        self.last_output_time: float | None = None
        self.metrics = metrics

    def deltas(self, out: RequestOutput, with_tokens: bool, announce: bool = False
               ) -> Iterator[tuple[CompletionOutput, str, int, int, bool]]:
        """Each choice with something new to stream: (output, text delta, index of its
        first unsent token, length of text already sent, is this its first chunk).
        A choice is due when its text grew, it finished, it has new tokens and
        `with_tokens` (logprobs ride on tokens), or it has sent nothing and
        `announce` (chat's role chunk). Marks what it yields as sent."""
        for c in out.outputs:
            i = c.index
            if self.finish_sent[i]:
                continue
            delta = c.text[self.text_len[i]:]
            new_tokens = len(c.token_ids) > self.num_tokens[i]
            first = not self.chunk_sent[i]
            if not (delta or c.finish_reason or (with_tokens and new_tokens)
                    or (announce and first)):
                continue
            yield c, delta, self.num_tokens[i], self.text_len[i], first
            self.chunk_sent[i] = True
            self.text_len[i] = len(c.text)
            self.num_tokens[i] = len(c.token_ids)
            self.finish_sent[i] = c.finish_reason is not None

    def chunk(self, request_id: str, model_name: str, choice: dict) -> dict:
        return {"id": request_id, "object": self.object, "created": self.created,
                "model": model_name, "choices": [choice]}

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if self.last_output_time is not None:
            self.metrics.observe_gap(now - self.last_output_time)
        self.last_output_time = now
        if out.finished:
            self.metrics.observe_finished(out)

    def end(self, stream: RequestStream, engine: AsyncEngine) -> None:
        """The consumer is done; a request that did not finish is aborted and counted."""
        if not stream.finished:  # the client left: free its KV blocks now
            engine.abort(stream.request_id)
        if not stream.finished or stream.aborted:
            self.metrics.observe_aborted()


def build_app(engine: AsyncEngine, served_model_name: str | None = None,
              api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The app in front of `engine`, whose loop the caller runs (`engine.run()`)."""
    llm = engine.engine
    tokenizer = llm.tokenizer
    model_name = served_model_name or llm.model_name
    vocab_size = llm.model_config.vocab_size
    metrics = ServerMetrics(lambda: engine.stats, model_name)
    token_text: dict[int, str] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible LLM server")
    app.add_middleware(_Gate, api_key=api_key, max_request_bytes=max_request_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), kind,
                                       headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(APIError(500, "internal server error", "server_error"))

    # ---- helpers -------------------------------------------------------------------

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{model_name!r}", param="model", code="model_not_found")

    def sampling_params(req: p.CompletionRequest | p.ChatCompletionRequest) -> SamplingParams:
        if any(t >= vocab_size for t in req.stop_token_ids or []):
            raise APIError(400, f"stop_token_ids must be in [0, {vocab_size})",
                           param="stop_token_ids")
        for s in [req.stop] if isinstance(req.stop, str) else req.stop or []:
            _check_text(s, "stop")
        try:
            return req.to_sampling_params()
        except ValueError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None

    def render_chat(messages: list[p.ChatMessage], add_generation_prompt: bool) -> list[int]:
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        for i, m in enumerate(conversation):
            _check_text(m["content"], f"messages.{i}.content")
        try:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja2 TemplateError/SecurityError, no template
            raise APIError(400, f"cannot apply the chat template: {str(e)[:300]}",
                           param="messages") from None
        # the template holds the special tokens already
        return tokenizer.encode(text, add_special_tokens=False)

    def completion_prompt(req: p.CompletionRequest) -> str | list[int]:
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > 1:
                raise APIError(400, "batched prompts are not supported; send one prompt "
                               "per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            _check_text(prompt, "prompt")
        elif any(t >= vocab_size for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})",
                           param="prompt")
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        return prompt

    async def submit(request_id: str, prompt: str | list[int],
                     params: SamplingParams) -> RequestStream:
        try:
            return await engine.add_request(request_id, prompt, params)
        except QueueFullError as e:
            raise APIError(503, str(e), "service_unavailable_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except EngineUnavailableError as e:
            raise APIError(503, str(e), "service_unavailable_error",
                           code="unavailable") from None
        except EngineStepError as e:
            raise APIError(500, str(e), "server_error") from None
        except ValueError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None

    async def collect(request: Request, request_id: str, stream: RequestStream,
                      progress: _Progress) -> RequestOutput:
        """Run a non-streamed request to the end; abort it if the client leaves."""
        watcher = asyncio.create_task(_abort_on_disconnect(request, engine, request_id))
        final = None
        try:
            async for out in stream:
                progress.observe(out)
                final = out
        except EngineStepError as e:
            raise APIError(500, str(e), "server_error") from None
        finally:
            watcher.cancel()
            progress.end(stream, engine)
        if final is None or not final.finished:
            raise APIError(503, "the request was aborted before it finished (server "
                           "shutting down)", "service_unavailable_error", code="aborted")
        return final

    def decode_token(token_id: int) -> str:
        text = token_text.get(token_id)
        if text is None:
            text = token_text[token_id] = tokenizer.decode([token_id])
        return text

    def completion_logprobs(choice: CompletionOutput, start: int,
                            text_offset: int) -> p.CompletionLogprobs:
        lp = p.CompletionLogprobs()
        for tid, entry in zip(choice.token_ids[start:], (choice.logprobs or [])[start:]):
            token = decode_token(tid)
            lp.tokens.append(token)
            lp.token_logprobs.append(_clamp(entry[tid].logprob) if tid in entry else None)
            lp.top_logprobs.append({decode_token(t): _clamp(v.logprob)
                                    for t, v in entry.items()})
            lp.text_offset.append(text_offset)
            text_offset += len(token)
        return lp

    def chat_logprobs(choice: CompletionOutput, start: int, top_k: int) -> p.ChatLogprobs:
        content = []
        for tid, entry in zip(choice.token_ids[start:], (choice.logprobs or [])[start:]):
            token = decode_token(tid)
            chosen = entry.get(tid)
            top = sorted(((t, v) for t, v in entry.items() if (v.rank or 0) <= top_k),
                         key=lambda kv: kv[1].rank or 0)[:top_k]
            content.append(p.ChatTokenLogprob(
                token=token, logprob=_clamp(chosen.logprob if chosen else None),
                bytes=list(token.encode("utf-8")),
                top_logprobs=[p.TopLogprob(token=decode_token(t), logprob=_clamp(v.logprob),
                                           bytes=list(decode_token(t).encode("utf-8")))
                              for t, v in top]))
        return p.ChatLogprobs(content=content)

    def usage(out: RequestOutput) -> p.UsageInfo:
        prompt_tokens = len(out.prompt_token_ids)
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens)

    async def sse(request_id: str, stream: RequestStream, progress: _Progress,
                  chunks: Any, include_usage: bool) -> AsyncIterator[str]:
        """SSE lines for one request; `chunks(out)` gives the events of one output."""
        last = None
        try:
            async for out in stream:
                progress.observe(out)
                last = out
                for event in chunks(out):
                    yield _sse_line(event)
            if stream.aborted:
                yield _sse_line(error_body("the request was aborted (server shutting down)",
                                           "service_unavailable_error", code="aborted"))
            elif include_usage and last is not None:
                yield _sse_line({"id": request_id, "object": progress.object,
                                 "created": progress.created, "model": model_name,
                                 "choices": [], "usage": p.dump(usage(last))})
        except EngineStepError as e:
            yield _sse_line(error_body(str(e), "server_error"))
        finally:
            progress.end(stream, engine)
        yield "data: [DONE]\n\n"

    # ---- routes --------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        ok, reason = engine.health()
        if ok:
            return Response(status_code=200)
        return JSONResponse(error_body(reason, "service_unavailable_error"), status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    # ---- /server_info (issue 22; the integrator moves it into the route modules) ----
    @app.get("/server_info")
    async def server_info_route() -> dict:
        from tokenmill.server.server_info import server_info

        return server_info(llm)
    # ---- end /server_info ----

    @app.get("/v1/models", response_model=p.ModelList)
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=model_name, root=llm.model_name,
                                             max_model_len=llm.max_model_len)])

    @app.post("/tokenize", response_model=p.TokenizeResponse)
    async def tokenize(req: p.TokenizeRequest) -> p.TokenizeResponse:
        check_model(req.model)
        if req.messages is not None:
            ids = render_chat(req.messages, req.add_generation_prompt)
        else:
            _check_text(req.prompt or "", "prompt")
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return p.TokenizeResponse(count=len(ids), max_model_len=llm.max_model_len,
                                  tokens=list(ids))

    @app.post("/detokenize", response_model=p.DetokenizeResponse)
    async def detokenize(req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        check_model(req.model)
        if any(t >= vocab_size for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab_size})", param="tokens")
        return p.DetokenizeResponse(prompt=tokenizer.decode(req.tokens))

    @app.post("/v1/completions", response_model=p.CompletionResponse,
              responses={400: {"model": p.ErrorResponse}, 404: {"model": p.ErrorResponse},
                         503: {"model": p.ErrorResponse}})
    async def completions(req: p.CompletionRequest, request: Request) -> Any:
        check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompt = completion_prompt(req)
        params = sampling_params(req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        progress = _Progress(req.n, metrics, "text_completion")
        stream = await submit(request_id, prompt, params)
        want_logprobs = req.logprobs is not None

        if req.stream:
            def chunks(out: RequestOutput) -> list[dict]:
                events = []
                for c, delta, first_token, sent_text, _ in progress.deltas(out, want_logprobs):
                    choice = p.CompletionChoice(
                        index=c.index, text=delta, finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        logprobs=completion_logprobs(c, first_token, sent_text)
                        if want_logprobs else None)
                    events.append(progress.chunk(request_id, model_name, p.dump(choice)))
                return events

            return StreamingResponse(sse(request_id, stream, progress, chunks,
                                         req.include_usage), media_type="text/event-stream")

        final = await collect(request, request_id, stream, progress)
        choices = [p.CompletionChoice(
            index=c.index, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            logprobs=completion_logprobs(c, 0, 0) if want_logprobs else None)
            for c in final.outputs]
        return JSONResponse(p.dump(p.CompletionResponse(
            id=request_id, created=progress.created, model=model_name, choices=choices,
            usage=usage(final))))

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse,
              responses={400: {"model": p.ErrorResponse}, 404: {"model": p.ErrorResponse},
                         503: {"model": p.ErrorResponse}})
    async def chat_completions(req: p.ChatCompletionRequest, request: Request) -> Any:
        check_model(req.model)
        params = sampling_params(req)
        prompt_ids = render_chat(req.messages, req.add_generation_prompt)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        progress = _Progress(req.n, metrics, "chat.completion.chunk")
        stream = await submit(request_id, prompt_ids, params)
        top_k = req.top_logprobs or 0

        if req.stream:
            def chunks(out: RequestOutput) -> list[dict]:
                events = []
                for c, delta, first_token, _, first in progress.deltas(
                        out, bool(req.logprobs), announce=True):
                    choice = p.ChatChunkChoice(
                        index=c.index,
                        delta=p.DeltaMessage(role="assistant" if first else None,
                                             content=delta),
                        finish_reason=c.finish_reason,
                        logprobs=chat_logprobs(c, first_token, top_k)
                        if req.logprobs else None)
                    dumped = p.dump(choice)
                    if dumped["delta"]["role"] is None:  # as OpenAI: role only in the first
                        del dumped["delta"]["role"]
                    events.append(progress.chunk(request_id, model_name, dumped))
                return events

            return StreamingResponse(sse(request_id, stream, progress, chunks,
                                         req.include_usage), media_type="text/event-stream")

        final = await collect(request, request_id, stream, progress)
        choices = [p.ChatChoice(
            index=c.index, message=p.ChatResponseMessage(content=c.text),
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            logprobs=chat_logprobs(c, 0, top_k) if req.logprobs else None)
            for c in final.outputs]
        return JSONResponse(p.dump(p.ChatCompletionResponse(
            id=request_id, created=progress.created, model=model_name, choices=choices,
            usage=usage(final))))

    app.state.engine = engine
    app.state.metrics = metrics
    return app


async def _abort_on_disconnect(request: Request, engine: AsyncEngine, request_id: str) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            engine.abort(request_id)
            return


def _clamp(logprob: float | None) -> float:
    if logprob is None or math.isnan(logprob):
        return _MIN_LOGPROB
    return max(logprob, _MIN_LOGPROB)


def _sse_line(event: dict) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
