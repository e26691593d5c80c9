"""docs/serving.md: "a client that disconnects has its request aborted within one engine step".
The loop drains aborts before every step, so once `abort` returns the request is in at
most the one step already running; no model: a fake engine records which requests
each step ran."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from tokenmill import SamplingParams
from tokenmill.engine.core.outputs import CompletionOutput, RequestOutput
from tokenmill.engine.core.stats import EngineStats
from tokenmill.engine.frontend.async_engine import AsyncEngine


class _CountingEngine:
    """Each step emits one token for every live request; steps wait for `go`."""

    config = SimpleNamespace(max_num_seqs=4)
    stats = EngineStats()

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.steps: list[set[str]] = []
        self.aborted_at_step: dict[str, int] = {}
        self.go = threading.Semaphore(0)

    def get_stats(self) -> EngineStats:
        return EngineStats()

    def add_request(self, request_id, prompt, params, arrival_time=None,
                    lora_request=None) -> None:
        self.live[request_id] = 0

    def abort_request(self, request_id) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            if self.live.pop(rid, None) is not None:
                self.aborted_at_step[rid] = len(self.steps)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> list[RequestOutput]:
        self.steps.append(set(self.live))  # recorded as it starts
        self.go.acquire()
        outs = []
        for rid in self.live:
            self.live[rid] += 1
            outs.append(RequestOutput(rid, None, [1], [CompletionOutput(
                0, "x" * self.live[rid], [7] * self.live[rid], None, None, None)], False))
        return outs


def test_abort_takes_effect_before_the_next_step():
    fake = _CountingEngine()
    abort_called_at: list[int] = []
    engine = AsyncEngine(fake)
    loop = threading.Thread(target=engine.run, daemon=True)
    loop.start()

    async def client() -> int:
        # another request keeps the loop stepping after "r" is gone
        await engine.add_request("other", [3], SamplingParams(max_tokens=1000))
        stream = await engine.add_request("r", [1, 2], SamplingParams(max_tokens=1000))
        received = 0
        async for _ in stream:
            received += 1
            if received == 3:
                break
        abort_called_at.append(len(fake.steps))
        engine.abort("r")  # the client left
        return received

    trickling = threading.Event()
    trickling.set()

    def release_steps() -> None:  # a step every 5 ms until the test has seen enough
        while trickling.is_set():
            fake.go.release()
            threading.Event().wait(0.005)

    threading.Thread(target=release_steps, daemon=True).start()
    received = asyncio.run(client())
    # let the loop run on: it must not step "r" again
    for _ in range(2000):
        if len(fake.steps) > abort_called_at[0] + 5:
            break
        threading.Event().wait(0.005)
    trickling.clear()
    for _ in range(4):
        fake.go.release()  # whatever step is waiting may finish
    engine.shutdown(5)
    loop.join(5)
    assert received == 3 and "r" in fake.aborted_at_step
    assert len(fake.steps) > abort_called_at[0] + 5  # the loop kept stepping
    # steps begun once abort() was called that still ran "r": at most one, the step
    # that had already drained the inbox when the abort arrived
    late = [i for i, live in enumerate(fake.steps) if i >= abort_called_at[0] and "r" in live]
    assert len(late) <= 1, late
