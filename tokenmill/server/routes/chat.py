"""POST /v1/chat/completions, whole or streamed, with tool calls (server/tool_calls.py)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.core.outputs import CompletionOutput, RequestOutput
from tokenmill.server import protocol as p
from tokenmill.server.json_body import OffLoopJSONRoute
from tokenmill.server.logprobs import chat_logprobs
from tokenmill.server.reasoning import ReasoningParser, ReasoningStream
from tokenmill.server.serving import ServingDep
from tokenmill.server.sse import event_stream
from tokenmill.server.streams import Part
from tokenmill.server.tool_calls import ToolPlan, plan_tools, with_tools
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
    model_name = serving.check_model(req.model)
    tools = plan_tools(req, serving.config.tool_call_parser)
    params = with_tools(serving.sampling_params(req), tools)
    prompt_ids = await serving.render_chat(req.messages, req, tools)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    parts = await serving.submit_all(request_id, [prompt_ids], params,
                                     "chat.completion.chunk",
                                     arrival_time=arrival)
    top_k = req.top_logprobs or 0
    decode = serving.decode_token

    reasoning = serving.reasoning_parser if req.separate_reasoning else None
    if req.stream:
        calls = [ToolCallStream(tools.parser) if tools and tools.parser else None
                 for _ in range(req.n)]
        thoughts = [ReasoningStream(reasoning) if reasoning else None for _ in range(req.n)]
        held = [""] * req.n  # reasoning not yet sent (stream_reasoning false)

        def chunks(part: Part, out: RequestOutput) -> list[dict]:
            events = []
            for c, delta, first_token, _, first in part.progress.deltas(
                    out, bool(req.logprobs), announce=True):
                tool_deltas = None
                finish_reason = c.finish_reason
                text, thought = c.text, None
                thinker = thoughts[c.index]
                if thinker is not None:
                    thought, delta, split = thinker.update(c.text, c.finished)
                    text = split.content
                    if not req.stream_reasoning:
                        held[c.index] += thought
                        thought = held[c.index] if split.reasoning_done else ""
                        held[c.index] = "" if split.reasoning_done else held[c.index]
                    thought = (thought or None) if req.include_reasoning else None
                call_stream = calls[c.index]
                if call_stream is not None and tools is not None:
                    delta, tool_deltas = call_stream.update(text, c.finished)
                    if not tools.parallel:
                        tool_deltas = [d for d in tool_deltas if d["index"] == 0]
                    if call_stream.called and finish_reason == "stop":
                        finish_reason = tools.finish_reason
                choice = p.ChatChunkChoice(
                    index=c.index,
                    delta=p.DeltaMessage(role="assistant" if first else None,
                                         content=delta or (None if tool_deltas or thought
                                                           else delta),
                                         reasoning_content=thought,
                                         tool_calls=tool_deltas or None),
                    finish_reason=finish_reason,
                    logprobs=chat_logprobs(c, first_token, top_k, decode)
                    if req.logprobs else None)
                dumped = p.dump(choice)
                if dumped["delta"]["role"] is None:  # as OpenAI: role only in the first
                    del dumped["delta"]["role"]
                for key in ("tool_calls", "reasoning_content"):
                    if dumped["delta"][key] is None:
                        del dumped["delta"][key]
                events.append(part.progress.chunk(request_id, model_name, dumped))
            return events

        return StreamingResponse(event_stream(serving, request_id, parts, chunks,
                                              req.include_usage, req.continuous_usage),
                                 media_type="text/event-stream")

    final, = await serving.collect(request, parts)
    choices = []
    for c in final.outputs:
        message, finish_reason = _message(c, tools, reasoning, req.include_reasoning)
        choices.append(p.ChatChoice(
            index=c.index, message=message, finish_reason=finish_reason,
            stop_reason=c.stop_reason,
            logprobs=chat_logprobs(c, 0, top_k, decode) if req.logprobs else None))
    body = p.dump(p.ChatCompletionResponse(
        id=request_id, created=parts[0].progress.created, model=model_name,
        choices=choices, usage=serving.usage([final])))
    if serving.reasoning_parser is None:  # without the flag, the response is as before
        for choice in body["choices"]:
            del choice["message"]["reasoning_content"]
    return JSONResponse(p.with_kv_transfer_params(body, [final]))


def _message(c: CompletionOutput, tools: ToolPlan | None, reasoning: ReasoningParser | None,
             include_reasoning: bool) -> tuple[p.ChatResponseMessage, str | None]:
    text, thought = c.text, None
    if reasoning is not None:
        split = reasoning.split(c.text, final=True)
        text, thought = split.content, split.reasoning if include_reasoning else None
    if tools is None or tools.parser is None:
        return p.ChatResponseMessage(content=text, reasoning_content=thought), c.finish_reason
    parsed = tools.parser.parse(text)
    calls = parsed.tool_calls if tools.parallel else parsed.tool_calls[:1]
    if not calls:
        return p.ChatResponseMessage(content=text, reasoning_content=thought), c.finish_reason
    finish_reason = tools.finish_reason if c.finish_reason == "stop" else c.finish_reason
    return p.ChatResponseMessage(content=parsed.content, reasoning_content=thought, tool_calls=[
        p.ToolCallOut(id=t.id, function=p.ToolCallFunction(name=t.name, arguments=t.arguments))
        for t in calls]), finish_reason
