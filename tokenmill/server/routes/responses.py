"""POST /v1/responses (whole or streamed as typed events), GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items: OpenAI's Responses
API over the chat path (server/responses/)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.core.outputs import RequestOutput
from tokenmill.engine.frontend.request_stream import (
    EngineDiedError,
    EngineStepError,
    EngineUnavailableError,
    StreamBehindError,
)
from tokenmill.server.errors import APIError
from tokenmill.server.json_body import OffLoopJSONRoute
from tokenmill.server.responses.conversation import output_messages
from tokenmill.server.responses.output import OutputBuilder, new_id
from tokenmill.server.responses.protocol import ResponsesRequest
from tokenmill.server.responses.request import Prepared, prepare
from tokenmill.server.responses.store import StoredResponse
from tokenmill.server.serving import Serving, ServingDep
from tokenmill.server.streams import Part, merge

router = APIRouter(route_class=OffLoopJSONRoute)


@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, request: Request,
                          serving: ServingDep) -> Any:
    arrival = getattr(request.state, "arrival_time", None) or time.monotonic()
    prepared = await prepare(req, serving)
    response_id = new_id("resp")
    parts = await serving.submit_all(response_id, [prepared.prompt_ids], prepared.params,
                                     "response", arrival_time=arrival)
    shape = _Shape(serving, req, prepared, response_id, parts[0].progress.created)
    builder = OutputBuilder(prepared.tools, serving.reasoning_parser)
    if req.stream:
        return StreamingResponse(_events(serving, shape, builder, parts[0]),
                                 media_type="text/event-stream")
    final, = await serving.collect(request, parts)
    completion = final.outputs[0]
    builder.update(completion.text, True, _status(completion.finish_reason))
    return JSONResponse(await shape.finish(builder, final))


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, serving: ServingDep) -> Any:
    return JSONResponse(_stored(serving, response_id).response)


@router.get("/v1/responses/{response_id}/input_items")
async def get_input_items(response_id: str, serving: ServingDep) -> Any:
    items = _stored(serving, response_id).input_items
    return JSONResponse({"object": "list", "data": items, "has_more": False,
                         "first_id": items[0].get("id") if items else None,
                         "last_id": items[-1].get("id") if items else None})


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, serving: ServingDep) -> Any:
    if not serving.responses.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _stored(serving: Serving, response_id: str) -> StoredResponse:
    stored = serving.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", "not_found_error",
                    param="response_id", code="not_found")


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class _Shape:
    """The response object of one request, at any stage; `finish` also stores it."""

    def __init__(self, serving: Serving, req: ResponsesRequest, prepared: Prepared,
                 response_id: str, created_at: int) -> None:
        self.serving, self.req, self.prepared = serving, req, prepared
        self.id, self.created_at = response_id, created_at

    def object(self, status: str, output: list[dict[str, Any]],
               usage: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None, "model": self.serving.model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": self.prepared.text_format},
            "tool_choice": self.prepared.tool_choice, "tools": self.prepared.tool_dicts,
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata or {}}

    async def finish(self, builder: OutputBuilder, final: RequestOutput) -> dict[str, Any]:
        reasoning = "".join(part["text"] for item in builder.items
                            if item["type"] == "reasoning" for part in item["content"])
        usage = self.serving.usage([final])
        reasoning_tokens = len(await self.serving.tokenizers.encode(reasoning, False)) \
            if reasoning else 0
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details \
            else 0
        response = self.object(builder.status, builder.items, {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.total_tokens})
        if self.req.store:
            self.serving.responses.put(self.id, StoredResponse(
                response, self.prepared.messages + output_messages(builder.items),
                self.prepared.input_items))
        return response


async def _events(serving: Serving, shape: _Shape, builder: OutputBuilder,
                  part: Part) -> AsyncIterator[str]:
    sequence_number = 0

    def sse(event: dict[str, Any]) -> str:
        nonlocal sequence_number
        event["sequence_number"] = sequence_number
        sequence_number += 1
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return f"event: {event['type']}\ndata: {data}\n\n"

    yield sse({"type": "response.created", "response": shape.object("in_progress", [])})
    yield sse({"type": "response.in_progress", "response": shape.object("in_progress", [])})
    last: RequestOutput | None = None
    try:
        async with aclosing(merge([part])) as outputs:
            async for _, out in outputs:
                part.progress.observe(out)
                last = out
                completion = out.outputs[0]
                for event in builder.update(completion.text, completion.finished,
                                            _status(completion.finish_reason)):
                    yield sse(event)
        if part.stream.aborted or last is None or not last.finished:
            yield sse(_error("the request was aborted (server shutting down)", "aborted"))
            return
        response = await shape.finish(builder, last)
        yield sse({"type": f"response.{response['status']}", "response": response})
    except EngineDiedError as e:
        yield sse(_error(str(e), "engine_down"))
    except StreamBehindError as e:
        yield sse(_error(str(e), "stream_too_slow"))
    except EngineUnavailableError as e:
        yield sse(_error(str(e), "unavailable"))
    except EngineStepError as e:
        yield sse(_error(str(e), "server_error"))
    finally:
        part.progress.end(part.stream, serving.engine)


def _error(message: str, code: str) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message, "param": None}
