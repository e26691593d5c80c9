"""The waiting-queue bound both engine clients (AsyncEngine in-process, CoreClient
beside a core process) apply when a request comes in (`--max-waiting`)."""

from __future__ import annotations

import threading
from typing import Any

from tokenmill.engine.frontend.request_stream import QueueFullError


class Admission:
    """Mixin: the class sets `_lock`, `_num_seqs_in_flight` (sequences handed to the
    engine and not yet finished), `max_num_seqs`, `max_waiting` (None: no bound) and
    `stats` (the engine's latest EngineStats) itself."""

    _lock: threading.Lock
    _num_seqs_in_flight: int
    max_num_seqs: int
    max_waiting: int | None
    stats: Any

    @property
    def num_waiting(self) -> int:
        """Sequences that wait for a running slot, counting those about to be added."""
        with self._lock:
            return self._num_waiting_locked()

    def _num_waiting_locked(self) -> int:
        beyond_batch = self._num_seqs_in_flight - self.max_num_seqs
        return max(beyond_batch, self.stats.num_waiting, 0)

    def _refuse_if_full_locked(self) -> None:
        """QueueFullError when the waiting queue is at --max-waiting."""
        waiting = self._num_waiting_locked()
        if self.max_waiting is not None and waiting >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({waiting} sequences); retry later")
