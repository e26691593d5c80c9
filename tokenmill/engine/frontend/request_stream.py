"""One request's outputs on their way to the event loop, and the errors that
can end them; shared by the in-process `AsyncEngine` and the `CoreClient` of
an engine core in another process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.core.outputs import RequestOutput


class QueueFullError(RuntimeError):
    """The waiting queue holds --max-waiting requests already: retry later."""

    retry_after_s = 1


class EngineUnavailableError(RuntimeError):
    """The engine is shutting down, dead or hung: no new requests for now."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineStepError(RuntimeError):
    """The engine failed while running this request; other requests carry on."""


class EngineDiedError(EngineStepError):
    """The engine core process died or hung while this request was in flight."""


class StreamBehindError(RuntimeError):
    """The consumer fell too far behind (a client that stops reading its stream):
    the request was aborted rather than buffering its outputs without bound."""


# outputs a stream may hold unread before its request is aborted; each output
# carries the text so far, so an unread backlog costs O(tokens^2) memory
DEFAULT_MAX_STREAM_BACKLOG = 512


@dataclass
class Accepted:
    """The engine's answer to an add: taken (error None), or why not."""

    error: BaseException | None = None


@dataclass
class Aborted:
    reason: str = "abort"


class RequestStream:
    """The outputs of one request, in order; iterate with `async for`.

    Ends after the output with `finished=True`; raises EngineStepError if the
    engine failed, and ends early if the request was aborted.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 num_seqs: int = 1, max_backlog: int = DEFAULT_MAX_STREAM_BACKLOG,
                 on_overflow: Any = None) -> None:
        self.request_id = request_id
        self.num_seqs = num_seqs
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False
        self.aborted = False
        self.max_backlog = max_backlog
        self.on_overflow = on_overflow  # called with the request id when it overflows
        self.overflowed = False

    def put(self, item: Any) -> None:  # any thread
        try:
            self.loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _deliver(self, item: Any) -> None:  # event loop
        if self.overflowed:
            return  # the abort's own Aborted, or outputs that were already in flight
        if isinstance(item, RequestOutput) and self.queue.qsize() >= self.max_backlog:
            self.overflowed = True
            while not self.queue.empty():  # free the backlog now, not when it is read
                self.queue.get_nowait()
            self.queue.put_nowait(StreamBehindError(
                f"the client read its stream too slowly ({self.max_backlog} outputs "
                "unread); the request was aborted"))
            if self.on_overflow is not None:
                self.on_overflow(self.request_id)
            return
        self.queue.put_nowait(item)

    async def accepted(self) -> None:
        """Wait for the engine's answer to the add; raise its refusal."""
        ack = await self.queue.get()
        if isinstance(ack, Accepted) and ack.error is not None:
            raise ack.error
        if isinstance(ack, Aborted):
            self.finished = self.aborted = True
        elif isinstance(ack, BaseException):
            self.finished = True
            raise ack

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, RequestOutput):
                self.finished = item.finished
                yield item
            elif isinstance(item, Aborted):
                self.finished = self.aborted = True
            elif isinstance(item, BaseException):
                self.finished = True
                raise item
