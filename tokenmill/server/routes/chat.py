"""POST /v1/chat/completions, whole or streamed."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.outputs import RequestOutput
from tokenmill.server import protocol as p
from tokenmill.server.logprobs import chat_logprobs
from tokenmill.server.serving import ServingDep
from tokenmill.server.sse import event_stream

router = APIRouter()

_ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": p.ErrorResponse} for s in (400, 404, 503)}


@router.post("/v1/chat/completions", response_model=p.ChatCompletionResponse,
             responses=_ERRORS)
async def chat_completions(req: p.ChatCompletionRequest, request: Request,
                           serving: ServingDep) -> Any:
    serving.check_model(req.model)
    params = serving.sampling_params(req)
    prompt_ids = serving.render_chat(req.messages, req.add_generation_prompt)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    progress = serving.progress(req.n, "chat.completion.chunk")
    stream = await serving.submit(request_id, prompt_ids, params)
    top_k = req.top_logprobs or 0
    decode = serving.decode_token

    if req.stream:
        def chunks(out: RequestOutput) -> list[dict]:
            events = []
            for c, delta, first_token, _, first in progress.deltas(
                    out, bool(req.logprobs), announce=True):
                choice = p.ChatChunkChoice(
                    index=c.index,
                    delta=p.DeltaMessage(role="assistant" if first else None, content=delta),
                    finish_reason=c.finish_reason,
                    logprobs=chat_logprobs(c, first_token, top_k, decode)
                    if req.logprobs else None)
                dumped = p.dump(choice)
                if dumped["delta"]["role"] is None:  # as OpenAI: role only in the first
                    del dumped["delta"]["role"]
                events.append(progress.chunk(request_id, serving.model_name, dumped))
            return events

        return StreamingResponse(event_stream(serving, request_id, stream, progress, chunks,
                                              req.include_usage),
                                 media_type="text/event-stream")

    final = await serving.collect(request, stream, progress)
    choices = [p.ChatChoice(
        index=c.index, message=p.ChatResponseMessage(content=c.text),
        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        logprobs=chat_logprobs(c, 0, top_k, decode) if req.logprobs else None)
        for c in final.outputs]
    return JSONResponse(p.dump(p.ChatCompletionResponse(
        id=request_id, created=progress.created, model=serving.model_name, choices=choices,
        usage=serving.usage(final))))
