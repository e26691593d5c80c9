"""POST /v1/chat/completions, whole or streamed, with tool calls (server/tool_calls.py)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.core.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server import protocol as p
from tokenmill.server.errors import APIError
from tokenmill.server.json_body import OffLoopJSONRoute
from tokenmill.server.logprobs import chat_logprobs
from tokenmill.server.serving import ServingDep
from tokenmill.server.sse import event_stream
from tokenmill.server.streams import Part
from tokenmill.server.tool_calls import ToolPlan, plan_tools
from tokenmill.tools import ToolCallStream

router = APIRouter(route_class=OffLoopJSONRoute)

_ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": p.ErrorResponse} for s in (400, 404, 503)}


@router.post("/v1/chat/completions", response_model=p.ChatCompletionResponse,
             responses=_ERRORS)
async def chat_completions(req: p.ChatCompletionRequest, request: Request,
                           serving: ServingDep) -> Any:
    # stamped by the Gate as the request came in: rendering, tokenizing count in TTFT
    arrival = getattr(request.state, "arrival_time", None) or time.monotonic()
    serving.check_model(req.model)
    tools = plan_tools(req, serving.config.tool_call_parser)
    params = _with_tools(serving.sampling_params(req), tools)
    prompt_ids = await serving.render_chat(req.messages, req, tools)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    parts = await serving.submit_all(request_id, [prompt_ids], params,
                                     "chat.completion.chunk",
                                     arrival_time=arrival)
    top_k = req.top_logprobs or 0
    decode = serving.decode_token

    if req.stream:
        calls = [ToolCallStream(tools.parser) if tools and tools.parser else None
                 for _ in range(req.n)]

        def chunks(part: Part, out: RequestOutput) -> list[dict]:
            events = []
            for c, delta, first_token, _, first in part.progress.deltas(
                    out, bool(req.logprobs), announce=True):
                tool_deltas = None
                finish_reason = c.finish_reason
                call_stream = calls[c.index]
                if call_stream is not None and tools is not None:
                    delta, tool_deltas = call_stream.update(c.text, c.finished)
                    if not tools.parallel:
                        tool_deltas = [d for d in tool_deltas if d["index"] == 0]
                    if call_stream.called and finish_reason == "stop":
                        finish_reason = tools.finish_reason
                choice = p.ChatChunkChoice(
                    index=c.index,
                    delta=p.DeltaMessage(role="assistant" if first else None,
                                         content=delta or (None if tool_deltas else delta),
                                         tool_calls=tool_deltas or None),
                    finish_reason=finish_reason,
                    logprobs=chat_logprobs(c, first_token, top_k, decode)
                    if req.logprobs else None)
                dumped = p.dump(choice)
                if dumped["delta"]["role"] is None:  # as OpenAI: role only in the first
                    del dumped["delta"]["role"]
                if dumped["delta"]["tool_calls"] is None:
                    del dumped["delta"]["tool_calls"]
                events.append(part.progress.chunk(request_id, serving.model_name, dumped))
            return events

        return StreamingResponse(event_stream(serving, request_id, parts, chunks,
                                              req.include_usage, req.continuous_usage),
                                 media_type="text/event-stream")

    final, = await serving.collect(request, parts)
    choices = []
    for c in final.outputs:
        message, finish_reason = _message(c, tools)
        choices.append(p.ChatChoice(
            index=c.index, message=message, finish_reason=finish_reason,
            stop_reason=c.stop_reason,
            logprobs=chat_logprobs(c, 0, top_k, decode) if req.logprobs else None))
    return JSONResponse(p.dump(p.ChatCompletionResponse(
        id=request_id, created=parts[0].progress.created, model=serving.model_name,
        choices=choices, usage=serving.usage([final]))))


def _with_tools(params: SamplingParams, tools: ToolPlan | None) -> SamplingParams:
    if tools is None:
        return params
    if tools.constraint is not None:
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice {tools.choice!r} constrains the output already; "
                           f"drop {params.structured_outputs.param}",
                           param=params.structured_outputs.param)
        params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
            tools.constraint, param="tools"))
    if tools.parser is not None and tools.parser.needs_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params


def _message(c: CompletionOutput, tools: ToolPlan | None
             ) -> tuple[p.ChatResponseMessage, str | None]:
    if tools is None or tools.parser is None:
        return p.ChatResponseMessage(content=c.text), c.finish_reason
    parsed = tools.parser.parse(c.text)
    calls = parsed.tool_calls if tools.parallel else parsed.tool_calls[:1]
    if not calls:
        return p.ChatResponseMessage(content=c.text), c.finish_reason
    finish_reason = tools.finish_reason if c.finish_reason == "stop" else c.finish_reason
    return p.ChatResponseMessage(content=parsed.content, tool_calls=[
        p.ToolCallOut(id=t.id, function=p.ToolCallFunction(name=t.name, arguments=t.arguments))
        for t in calls]), finish_reason
