"""Large JSON bodies parsed in a worker thread, not on the event loop.

json.loads of a 7 MB prompt takes tens of milliseconds of CPU (far more on a
busy machine) during which no stream on the event loop gets a chunk out; in a
thread it holds the GIL only in 5 ms slices, so other streams keep flowing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

LARGE_BODY_BYTES = 256 * 2**10


class _OffLoopJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > LARGE_BODY_BYTES:
                self._json = await asyncio.to_thread(json.loads, body)
            else:
                self._json = json.loads(body)
        return self._json


class OffLoopJSONRoute(APIRoute):
    """A route whose request body, when large, is parsed off the event loop."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_OffLoopJSONRequest(request.scope, request.receive,
                                                     request._send))

        return route
