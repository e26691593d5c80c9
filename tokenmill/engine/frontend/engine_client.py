"""What the server needs of an engine: two implementations, one interface.

`AsyncEngine` runs the engine loop in the server's own process
(`--engine-in-process`); `CoreClient` talks to an engine core process.
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenmill.engine.frontend.request_stream import RequestStream
from tokenmill.sampling_params import SamplingParams


class EngineClient(Protocol):
    engine: Any  # the model's names, tokenizer, max_model_len, model_config
    stats: Any  # the latest EngineStats snapshot, replaced whole
    core_pid: int | None  # the engine core process, None when in-process

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    def health(self) -> tuple[bool, str]: ...

    def shutdown(self, timeout_s: float = 10.0) -> None: ...
