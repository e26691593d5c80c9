"""The engine loop behind the server: run on the calling thread (as `tokenmill serve`
does) or on a worker thread, and what the server sees when it dies."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from tokenmill.engine.core.stats import EngineStats
from tokenmill.engine.frontend.async_engine import AsyncEngine, EngineUnavailableError


class _BrokenEngine:
    """Enough of LLMEngine for the loop; fails outside a step, which kills the loop."""

    config = SimpleNamespace(max_num_seqs=4)
    stats = EngineStats()

    def get_stats(self) -> EngineStats:
        return self.stats

    def has_unfinished_requests(self) -> bool:
        raise RuntimeError("broken")


def test_run_on_the_calling_thread_returns_after_stop():
    engine = AsyncEngine(SimpleNamespace(config=SimpleNamespace(max_num_seqs=4),
                                         get_stats=EngineStats,
                                         has_unfinished_requests=lambda: False))
    threading.Timer(0.2, engine.stop).start()
    engine.run()  # returns once stopped: `tokenmill serve` then exits
    assert engine.health() == (False, "the engine loop is not running")


def test_a_dead_loop_reports_unhealthy_and_refuses_requests():
    engine = AsyncEngine(_BrokenEngine())
    engine.run()  # dies at once, logged, without raising
    ok, reason = engine.health()
    assert not ok and "internal error" in reason

    async def add():
        from tokenmill import SamplingParams
        await engine.add_request("r", [1, 2, 3], SamplingParams())

    with pytest.raises(EngineUnavailableError):
        asyncio.run(add())
