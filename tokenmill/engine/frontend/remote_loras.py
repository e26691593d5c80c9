"""The served LoRA adapters as the front end sees them beside an engine core process.

The same face as `LoRAManager` where the server reads it (`served`, `lookup`, `add`,
`remove`), so /v1/models, a request's `model` and the runtime load/unload routes work
alike in both layouts. The adapters themselves live in the core: `add` and `remove`
ask it over the IPC and wait for its answer; `served` is the core's last word on
which names are served (start-up's --lora-modules, then each answer).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from tokenmill.engine.frontend import core_messages as m
from tokenmill.loaders.errors import LoRAAdapterError
from tokenmill.lora_request import LoRARequest, UnknownLoRAError

# loading reads and checks a safetensors file between two engine steps: seconds at most
CALL_TIMEOUT_S = 120.0


class RemoteLoRAs:
    def __init__(self, served: list[LoRARequest],
                 send: Callable[[m.LoadLoRA | m.UnloadLoRA], bool]) -> None:
        """`send`: hands a message to the core (False: the core is not reachable)."""
        self.served: dict[str, LoRARequest] = {r.lora_name: r for r in served}
        self._send = send
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[threading.Event, list[m.LoRAUpdated]]] = {}

    def lookup(self, name: str) -> LoRARequest | None:
        return self.served.get(name)

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve `path` as `name` (the core loads and checks it now). Blocking: call it
        off the event loop. Raises LoRAAdapterError (a 400) with the core's words."""
        self._call(lambda call_id: m.LoadLoRA(call_id, name, str(path)))
        return self.served[name]

    def remove(self, name: str) -> None:
        """Raises UnknownLoRAError (a 404) or LoRAAdapterError (in use: a 400)."""
        self._call(lambda call_id: m.UnloadLoRA(call_id, name))

    def answered(self, reply: m.LoRAUpdated) -> None:
        """The core's answer (the client's reader thread)."""
        with self._lock:
            self.served = {r.lora_name: r for r in reply.served}  # replaced whole
            waiter = self._waiting.pop(reply.call_id, None)
        if waiter is not None:
            waiter[1].append(reply)
            waiter[0].set()

    def _call(self, make: Callable[[int], m.LoadLoRA | m.UnloadLoRA]) -> None:
        done: threading.Event = threading.Event()
        box: list[m.LoRAUpdated] = []
        with self._lock:
            call_id = next(self._ids)
            self._waiting[call_id] = (done, box)
        if not self._send(make(call_id)) or not done.wait(CALL_TIMEOUT_S):
            with self._lock:
                self._waiting.pop(call_id, None)
            raise LoRAAdapterError("the engine core did not answer the LoRA adapter "
                                   "update", "lora_name")
        reply = box[0]
        if reply.error is None:
            return
        if reply.not_found:
            raise UnknownLoRAError(reply.error)
        raise LoRAAdapterError(reply.error, reply.param or "lora_name")
