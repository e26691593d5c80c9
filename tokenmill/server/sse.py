"""Server-sent events for one streamed request: its chunks, an error event if
the engine fails or aborts it, the usage chunk, then `[DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from tokenmill.engine.async_engine import EngineStepError, RequestStream
from tokenmill.engine.outputs import RequestOutput
from tokenmill.server import protocol as p
from tokenmill.server.errors import error_body
from tokenmill.server.progress import Progress
from tokenmill.server.serving import Serving

Chunks = Callable[[RequestOutput], list[dict]]


def sse_line(event: dict) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def event_stream(serving: Serving, request_id: str, stream: RequestStream,
                       progress: Progress, chunks: Chunks,
                       include_usage: bool) -> AsyncIterator[str]:
    """SSE lines for one request; `chunks(out)` gives the events of one output."""
    last = None
    try:
        async for out in stream:
            progress.observe(out)
            last = out
            for event in chunks(out):
                yield sse_line(event)
        if stream.aborted:
            yield sse_line(error_body("the request was aborted (server shutting down)",
                                      "service_unavailable_error", code="aborted"))
        elif include_usage and last is not None:
            yield sse_line({"id": request_id, "object": progress.object,
                            "created": progress.created, "model": serving.model_name,
                            "choices": [], "usage": p.dump(serving.usage(last))})
    except EngineStepError as e:
        yield sse_line(error_body(str(e), "server_error"))
    finally:
        progress.end(stream, serving.engine)
    yield "data: [DONE]\n\n"
