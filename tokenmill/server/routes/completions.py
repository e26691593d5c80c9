"""POST /v1/completions, whole or streamed: one prompt or a batch (choice index
= prompt_i * n + j, as OpenAI), echo, logprobs and vLLM's prompt_logprobs."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.engine.core.outputs import CompletionOutput, RequestOutput
from tokenmill.server import protocol as p
from tokenmill.server.errors import APIError
from tokenmill.server.json_body import OffLoopJSONRoute
from tokenmill.server.logprobs import (
    completion_logprobs,
    echoed_prompt_logprobs,
    joined,
    vllm_prompt_logprobs,
)
from tokenmill.server.serving import Serving, ServingDep
from tokenmill.server.sse import event_stream
from tokenmill.server.streams import Part

router = APIRouter(route_class=OffLoopJSONRoute)

_ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": p.ErrorResponse} for s in (400, 404, 503)}


class _Choices:
    """Shapes one engine output of one prompt into completion choices."""

    def __init__(self, serving: Serving, req: p.CompletionRequest) -> None:
        self.serving, self.req = serving, req
        self.want_logprobs = req.logprobs is not None
        self._echo_text: dict[int, str] = {}  # prompt index -> its text

    async def prepare_echo(self, prompts: list[str | list[int]]) -> None:
        """The text each prompt echoes: its own string, or its ids decoded (in the pool)."""
        for i, prompt in enumerate(prompts if self.req.echo else []):
            self._echo_text[i] = prompt if isinstance(prompt, str) else \
                await self.serving.decode(prompt)

    def choice(self, part: Part, out: RequestOutput, c: CompletionOutput, delta: str,
               first_token: int, sent_text: int, first: bool) -> p.CompletionChoice:
        """`delta`: new text from token `first_token` on, after `sent_text` characters
        already sent of this choice; `first`: nothing was sent of it yet."""
        req, decode = self.req, self.serving.decode_token
        prefix = self._echo_text[part.first_index // req.n] if req.echo else ""
        text, lp = ("", None) if req.prompt_only else (delta, None)
        if self.want_logprobs:
            lp = p.CompletionLogprobs() if req.prompt_only else \
                completion_logprobs(c, first_token, sent_text + len(prefix), decode)
            if req.echo and first:
                lp = joined(echoed_prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                   decode), lp)
        if req.echo and first:
            text = prefix + text
        prompt_lp = vllm_prompt_logprobs(out.prompt_logprobs, decode) \
            if first and req.prompt_logprobs is not None else None
        finish = "length" if req.prompt_only and c.finish_reason else c.finish_reason
        return p.CompletionChoice(
            index=part.first_index + c.index, text=text, logprobs=lp, finish_reason=finish,
            stop_reason=None if req.prompt_only else c.stop_reason, prompt_logprobs=prompt_lp)


@router.post("/v1/completions", response_model=p.CompletionResponse, responses=_ERRORS)
async def completions(req: p.CompletionRequest, request: Request,
                      serving: ServingDep) -> Any:
    # stamped by the Gate as the request came in: parsing, tokenizing count in TTFT
    arrival = getattr(request.state, "arrival_time", None) or time.monotonic()
    model_name = serving.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    prompts = serving.completion_prompts(req)
    params = serving.sampling_params(req)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    shape = _Choices(serving, req)
    await shape.prepare_echo(prompts)
    parts = await serving.submit_all(request_id, prompts, params, "text_completion",
                                     arrival_time=arrival)

    if req.stream:
        def chunks(part: Part, out: RequestOutput) -> list[dict]:
            events = []
            for c, delta, first_token, sent_text, first in part.progress.deltas(
                    out, shape.want_logprobs, announce=req.echo):
                choice = shape.choice(part, out, c, delta, first_token, sent_text, first)
                events.append(part.progress.chunk(request_id, model_name,
                                                  p.dump(choice)))
            return events

        return StreamingResponse(event_stream(serving, request_id, parts, chunks,
                                              req.include_usage, req.continuous_usage,
                                              req.prompt_only),
                                 media_type="text/event-stream")

    finals = await serving.collect(request, parts)
    choices = [shape.choice(part, final, c, c.text, 0, 0, True)
               for part, final in zip(parts, finals) for c in final.outputs]
    body = p.dump(p.CompletionResponse(
        id=request_id, created=parts[0].progress.created, model=model_name,
        choices=choices, usage=serving.usage(finals, req.prompt_only)))
    return JSONResponse(p.with_kv_transfer_params(body, finals))
