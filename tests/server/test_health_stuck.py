"""`GET /health` is 200 while the engine loop steps and 503 once a step has run longer
than `stuck_after_s` (docs/serving.md: "200 while the engine loop is alive and stepping, 503
otherwise"), and 200 again when the step returns. A fake engine whose step blocks
stands in for a hung kernel; no model is loaded."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from tokenmill.engine.core.stats import EngineStats
from tokenmill.engine.frontend.async_engine import AsyncEngine


class _HangingEngine:
    """Enough of LLMEngine for the loop and the app; `step` blocks until released."""

    config = SimpleNamespace(max_num_seqs=4)
    tokenizer = None
    model_name = "fake"
    model_config = SimpleNamespace(vocab_size=16)

    def __init__(self) -> None:
        self.stats = EngineStats()
        self.busy = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def get_stats(self) -> EngineStats:
        return self.stats

    def has_unfinished_requests(self) -> bool:
        return self.busy

    def step(self) -> list:
        self.entered.set()
        self.release.wait(30)
        self.busy = False
        return []


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def hanging():
    fake = _HangingEngine()
    engine = AsyncEngine(fake, stuck_after_s=0.2)
    loop = threading.Thread(target=engine.run, daemon=True)
    loop.start()
    yield fake, engine
    fake.release.set()
    engine.shutdown(5)
    loop.join(5)


def test_a_stuck_step_makes_health_unhealthy_until_it_returns(hanging):
    fake, engine = hanging
    assert engine.health() == (True, "ok")
    fake.busy = True
    engine._wake.set()
    assert fake.entered.wait(10)
    assert _wait_for(lambda: not engine.health()[0]), "health never noticed the stuck step"
    assert "has run for over" in engine.health()[1]
    fake.release.set()
    assert _wait_for(lambda: engine.health()[0]), "health did not recover after the step"


def test_http_health_is_503_with_the_reason_while_stuck(hanging):
    import asyncio

    from tokenmill.loaders import load_tokenizer, resolve_model
    from tokenmill.server.api import build_app

    fake, engine = hanging
    # the app tokenizes and renders templates itself: it needs the real tokenizer
    fake.tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
    fake.model_config = SimpleNamespace(vocab_size=len(fake.tokenizer))
    fake.max_model_len = 2048
    app = build_app(engine)

    async def get_health() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/health")

    assert asyncio.run(get_health()).status_code == 200
    fake.busy = True
    engine._wake.set()
    assert fake.entered.wait(10)
    assert _wait_for(lambda: not engine.health()[0])
    r = asyncio.run(get_health())
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "service_unavailable_error"
    assert "has run for over" in r.json()["error"]["message"]
    fake.release.set()
    assert _wait_for(lambda: engine.health()[0])
    assert asyncio.run(get_health()).status_code == 200
