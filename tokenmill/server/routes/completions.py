"""POST /v1/completions, whole or streamed."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.outputs import RequestOutput
from tokenmill.server import protocol as p
from tokenmill.server.errors import APIError
from tokenmill.server.logprobs import completion_logprobs
from tokenmill.server.serving import ServingDep
from tokenmill.server.sse import event_stream

router = APIRouter()

_ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": p.ErrorResponse} for s in (400, 404, 503)}


@router.post("/v1/completions", response_model=p.CompletionResponse, responses=_ERRORS)
async def completions(req: p.CompletionRequest, request: Request,
                      serving: ServingDep) -> Any:
    serving.check_model(req.model)
    if req.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    prompt = serving.completion_prompt(req)
    params = serving.sampling_params(req)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    progress = serving.progress(req.n, "text_completion")
    stream = await serving.submit(request_id, prompt, params)
    want_logprobs = req.logprobs is not None
    decode = serving.decode_token

    if req.stream:
        def chunks(out: RequestOutput) -> list[dict]:
            events = []
            for c, delta, first_token, sent_text, _ in progress.deltas(out, want_logprobs):
                choice = p.CompletionChoice(
                    index=c.index, text=delta, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=completion_logprobs(c, first_token, sent_text, decode)
                    if want_logprobs else None)
                events.append(progress.chunk(request_id, serving.model_name, p.dump(choice)))
            return events

        return StreamingResponse(event_stream(serving, request_id, stream, progress, chunks,
                                              req.include_usage),
                                 media_type="text/event-stream")

    final = await serving.collect(request, stream, progress)
    choices = [p.CompletionChoice(
        index=c.index, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        logprobs=completion_logprobs(c, 0, 0, decode) if want_logprobs else None)
        for c in final.outputs]
    return JSONResponse(p.dump(p.CompletionResponse(
        id=request_id, created=progress.created, model=serving.model_name, choices=choices,
        usage=serving.usage(final))))
