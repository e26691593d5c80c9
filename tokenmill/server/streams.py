"""One HTTP request may hold several engine requests (a batch of completion
prompts): each is a `Part`, and `merge` interleaves their outputs as they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tokenmill.engine.core.outputs import RequestOutput
from tokenmill.engine.frontend.async_engine import RequestStream
from tokenmill.server.progress import Progress


@dataclass
class Part:
    stream: RequestStream
    progress: Progress
    prompt: str | list[int]
    first_index: int  # of its choices in the response: prompt_i * n, as OpenAI


async def merge(parts: list[Part]) -> AsyncIterator[tuple[Part, RequestOutput]]:
    """Each part's outputs in its own order, the parts interleaved; an engine
    error of any part is raised here. Closing the iterator stops the pumps."""
    if len(parts) == 1:
        async for out in parts[0].stream:
            yield parts[0], out
        return
    queue: asyncio.Queue[tuple[Part, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(part: Part) -> None:
        try:
            async for out in part.stream:
                queue.put_nowait((part, out))
            queue.put_nowait((part, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((part, e))

    tasks = [asyncio.create_task(pump(part)) for part in parts]
    try:
        remaining = len(parts)
        while remaining:
            part, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield part, item
    finally:
        for task in tasks:
            task.cancel()
