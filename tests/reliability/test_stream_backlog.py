"""A request's stream holds at most `max_backlog` unread outputs: one more and
the backlog is dropped, the request aborted, and the reader told why."""

from __future__ import annotations

import asyncio

import pytest

from tokenmill.engine.core.outputs import RequestOutput
from tokenmill.engine.frontend.request_stream import Aborted, RequestStream, StreamBehindError


def _out(finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [], finished)


def test_a_stream_past_its_backlog_is_aborted_and_says_why():
    async def run() -> tuple[list[str], int, list]:
        aborted: list[str] = []
        stream = RequestStream("r", asyncio.get_running_loop(), max_backlog=3,
                               on_overflow=aborted.append)
        for _ in range(5):  # the engine keeps producing; nobody reads
            stream.put(_out())
        stream.put(Aborted())  # the abort's own reply, ignored once overflowed
        await asyncio.sleep(0)
        queued = stream.queue.qsize()
        got = []
        with pytest.raises(StreamBehindError, match="too slowly"):
            async for out in stream:
                got.append(out)
        return aborted, queued, got

    aborted, queued, got = asyncio.run(run())
    assert aborted == ["r"]
    assert queued == 1  # the backlog was freed: only the error is left
    assert got == []


def test_a_reader_that_keeps_up_gets_everything():
    async def run() -> int:
        stream = RequestStream("r", asyncio.get_running_loop(), max_backlog=3,
                               on_overflow=lambda rid: pytest.fail("overflowed"))
        for _ in range(3):
            stream.put(_out())
        await asyncio.sleep(0)
        count = 0
        async for _ in stream:
            count += 1
            if count == 3:
                stream.put(_out(finished=True))
        return count

    assert asyncio.run(run()) == 4
