"""The in-memory response store: what `GET /v1/responses/{id}` returns and what
`previous_response_id` continues from. Bounded by count; the least recently
used response is evicted first (OpenAI keeps them 30 days; a server keeps
what fits). Responses sent with `store: false` never enter it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenmill.server import protocol as p
from tokenmill.server.serving_config import DEFAULT_MAX_RESPONSES


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as it was returned
    # the whole conversation so far: earlier turns, this input, this output
    # (instructions excluded: OpenAI does not carry them over)
    messages: list[p.ChatMessage]
    input_items: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        if max_responses < 0:
            raise ValueError(f"the response store size must be >= 0, got {max_responses}")
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.max_responses == 0:
            return
        with self._lock:
            self._responses[response_id] = stored
            self._responses.move_to_end(response_id)
            while len(self._responses) > self.max_responses:
                self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._responses.get(response_id)
            if stored is not None:
                self._responses.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._responses.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._responses)
