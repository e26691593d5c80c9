"""Server-sent events for one streamed HTTP request (one or several engine
requests): their chunks, an error event if the engine fails or aborts one,
the usage chunk, then `[DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from tokenmill.engine.core.outputs import RequestOutput
from tokenmill.engine.frontend.request_stream import (
    EngineDiedError,
    EngineStepError,
    EngineUnavailableError,
    StreamBehindError,
)
from tokenmill.server import protocol as p
from tokenmill.server.errors import error_body
from tokenmill.server.serving import Serving
from tokenmill.server.streams import Part, merge

Chunks = Callable[[Part, RequestOutput], list[dict]]


def sse_line(event: dict) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def event_stream(serving: Serving, request_id: str, parts: list[Part], chunks: Chunks,
                       include_usage: bool, continuous_usage: bool = False,
                       prompt_only: bool = False) -> AsyncIterator[str]:
    """SSE lines; `chunks(part, out)` gives the events of one output. With
    `continuous_usage` (vLLM) each chunk carries its prompt's usage so far."""
    last: dict[int, RequestOutput] = {}
    progress = parts[0].progress
    model = serving.model_name  # the chunks' own (an adapter's name, for an adapter request)
    try:
        async with aclosing(merge(parts)) as outputs:
            async for part, out in outputs:
                part.progress.observe(out)
                last[id(part)] = out
                for event in chunks(part, out):
                    model = event.get("model", model)
                    if continuous_usage:
                        event["usage"] = p.dump(serving.usage([out], prompt_only))
                    yield sse_line(event)
        if any(part.stream.aborted for part in parts):
            yield sse_line(error_body("the request was aborted (server shutting down)",
                                      "service_unavailable_error", code="aborted"))
        elif include_usage and last:
            yield sse_line({"id": request_id, "object": progress.object,
                            "created": progress.created, "model": model,
                            "choices": [],
                            "usage": p.dump(serving.usage(list(last.values()), prompt_only))})
    except EngineDiedError as e:  # the engine core died or hung mid-stream
        yield sse_line(error_body(str(e), "service_unavailable_error", code="engine_down"))
    except StreamBehindError as e:  # reaches the client only if it reads again
        yield sse_line(error_body(str(e), "invalid_request_error", code="stream_too_slow"))
    except EngineUnavailableError as e:  # the engine loop died under the stream
        yield sse_line(error_body(str(e), "service_unavailable_error", code="unavailable"))
    except EngineStepError as e:
        yield sse_line(error_body(str(e), "server_error"))
    finally:
        for part in parts:
            part.progress.end(part.stream, serving.engine)
    yield "data: [DONE]\n\n"
