"""A tiny OpenAI-compatible SSE server with a known chunk schedule, for testing the bench
client and metrics without an engine, and a whitespace tokenizer to count its words."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.serving import free_port


class WordTokenizer:
    """One token per space-separated word, with character offsets."""

    all_special_ids = ()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(w) for w in text.split()]

    def __call__(self, text: str, add_special_tokens: bool = False,
                 return_offsets_mapping: bool = False) -> dict:
        offsets, pos = [], 0
        for w in text.split():
            start = text.index(w, pos)
            offsets.append((start, start + len(w)))
            pos = start + len(w)
        return {"input_ids": [len(w) for w in text.split()], "offset_mapping": offsets}


class VllmMetrics:
    """What the fake did, exposed under vLLM's metric names (`vllm:*`), observed the way
    vLLM observes them: TTFT and E2E from the request's arrival, ITL per chunk gap."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        lab = ["model_name"]
        buckets = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "", lab, buckets=buckets,
                              registry=r).labels("fake")
        self.itl = Histogram("vllm:inter_token_latency_seconds", "", lab, buckets=buckets,
                             registry=r).labels("fake")
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "", lab, buckets=buckets,
                             registry=r).labels("fake")
        self.queue = Histogram("vllm:request_queue_time_seconds", "", lab, buckets=buckets,
                               registry=r).labels("fake")
        self.prompt = Counter("vllm:prompt_tokens", "", lab, registry=r).labels("fake")
        self.generation = Counter("vllm:generation_tokens", "", lab, registry=r).labels("fake")
        self.running = Gauge("vllm:num_requests_running", "", lab, registry=r).labels("fake")
        self.waiting = Gauge("vllm:num_requests_waiting", "", lab, registry=r).labels("fake")
        self.kv = Gauge("vllm:kv_cache_usage_perc", "", lab, registry=r).labels("fake")

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


async def _stream(body: dict, chat: bool, stats: VllmMetrics | None = None):
    """Role chunk (chat), then `max_tokens` words in chunks of `chunk_tokens`, one chunk
    every `gap_ms` after a first delay of `ttft_ms`; usage; [DONE]. With `timings`, the
    last chunk carries llama-server's `timings` object. `cpu_ms_per_chunk` busy-waits
    (holding the server's event loop, as a compute-bound server would)."""
    arrival = time.perf_counter()
    fake = body.get("fake") or {}
    n = int(body.get("max_tokens") or 16)
    per_chunk = int(fake.get("chunk_tokens", 1))
    die_after = fake.get("die_after")
    usage_delta = int(fake.get("usage_delta", 0))
    created = int(time.time())

    def chunk(text: str | None, finish: str | None = None, role: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish}
            obj = "text_completion"
        return "data: " + json.dumps({"id": "x", "object": obj, "created": created,
                                      "model": "fake", "choices": [choice]}) + "\n\n"

    if chat:
        yield chunk(None, role=True)
    if fake.get("burst"):  # as fast as it can: pre-made chunks, `burst` events per write
        async for part in _burst(n, int(fake["burst"]), fake.get("gap_ms", 0), chunk):
            yield part
        return
    if stats:
        stats.running.inc()
        stats.queue.observe(0.0)
    await asyncio.sleep(fake.get("ttft_ms", 50) / 1000)
    sent = chunks = 0
    last = first = arrival
    while sent < n:
        k = min(per_chunk, n - sent)
        if chunks:
            await asyncio.sleep(fake.get("gap_ms", 10) / 1000)
        if die_after is not None and chunks >= die_after:
            raise RuntimeError("fake server dies mid-stream")
        spin_until = time.perf_counter() + fake.get("cpu_ms_per_chunk", 0) / 1000
        while time.perf_counter() < spin_until:
            pass
        now = time.perf_counter()
        if stats and chunks:
            stats.itl.observe(now - last)
        elif stats:
            stats.ttft.observe(now - arrival)
        first = first if chunks else now
        last = now
        yield chunk(" w" * k)
        sent += k
        chunks += 1
    prompt = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
    if stats:
        stats.e2e.observe(last - arrival)
        stats.prompt.inc(len(prompt.split()))
        stats.generation.inc(n)
        stats.running.dec()
    end = chunk("", finish="length")
    if fake.get("timings"):  # llama-server: prompt processing, then decode per token
        end = end[:-3] + ', "timings": ' + json.dumps({
            "prompt_n": len(prompt.split()), "prompt_ms": 1e3 * (first - arrival),
            "predicted_n": n, "predicted_ms": 1e3 * (last - first),
            "predicted_per_token_ms": 1e3 * (last - first) / max(1, n - 1)}) + "}\n\n"
    yield end
    usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n + usage_delta,
             "total_tokens": len(prompt.split()) + n + usage_delta}
    yield "data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\n"
    yield "data: [DONE]\n\n"


async def _burst(n: int, burst: int, gap_ms: float, chunk):
    """`n` one-token content chunks, made once and written `burst` at a time (a
    `gap_ms` pause between writes), then the finish chunk, usage and [DONE]."""
    one = chunk(" w")
    sent = 0
    while sent < n:
        k = min(burst, n - sent)
        yield one * k
        sent += k
        if gap_ms:
            await asyncio.sleep(gap_ms / 1000)
    usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
    yield (chunk("", finish="length") + "data: " + json.dumps({"choices": [], "usage": usage})
           + "\n\ndata: [DONE]\n\n")


async def models(request: Request):
    return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})


class FakeServer:
    """`vllm_metrics=True` adds a `/metrics` page with vLLM's names; without it
    `/metrics` is a 404, as on a server that exposes none. `props` is served at `/props`
    (llama-server's route; a 404 without it)."""

    def __init__(self, vllm_metrics: bool = False, props: dict | None = None) -> None:
        self.props = props
        self.app = self.build_app(vllm_metrics)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1",
                                                    port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def build_app(self, vllm_metrics: bool) -> Starlette:
        self.stats = VllmMetrics() if vllm_metrics else None
        self.bodies: list[dict] = []  # every request body received, in order

        async def completions(request: Request):
            body = await request.json()
            self.bodies.append(body)
            fake = body.get("fake") or {}
            if fake.get("reject") and fake["reject"] in body:  # a strict server
                return JSONResponse({"error": {
                    "message": f"Unrecognized request argument supplied: {fake['reject']}",
                    "param": fake["reject"]}}, status_code=400)
            if fake.get("status"):
                return JSONResponse({"error": {"message": "nope"}},
                                    status_code=body["fake"]["status"])
            return StreamingResponse(_stream(body, False, self.stats),
                                     media_type="text/event-stream")

        async def chat(request: Request):
            body = await request.json()
            self.bodies.append(body)
            return StreamingResponse(_stream(body, True, self.stats),
                                     media_type="text/event-stream")

        async def metrics(request: Request):
            if self.stats is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return Response(self.stats.render(), media_type="text/plain")

        async def props(request: Request):
            body = getattr(self, "props", None)
            return JSONResponse(body or {"detail": "Not Found"}, status_code=200 if body else 404)

        return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                                 Route("/v1/chat/completions", chat, methods=["POST"]),
                                 Route("/v1/models", models), Route("/metrics", metrics),
                                 Route("/props", props)])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def app_factory() -> Starlette:
    """The fake's app alone, for `uvicorn --factory` in worker processes of its own."""
    return FakeServer.build_app(FakeServer.__new__(FakeServer), vllm_metrics=False)


if __name__ == "__main__":  # python -m tests.bench.fakes PORT [SERVER_PROCESSES]
    import sys

    uvicorn.run("tests.bench.fakes:app_factory", factory=True, host="127.0.0.1",
                port=int(sys.argv[1]), workers=int(sys.argv[2]) if len(sys.argv) > 2 else 1,
                log_level="error")


class FakeTarget:
    """An in-process fake server for the load generator's statistics: run k of it serves
    every request with TTFT and per-token gap set by a seeded draw for k (speed × a
    ±`jitter` factor), so repeats differ the way real runs do yet every test run sees the
    same numbers. Timestamps are computed, not slept."""

    tokenizer = None

    def __init__(self, ttft_s: float = 0.05, gap_s: float = 0.01, jitter: float = 0.1,
                 seed: int = 0) -> None:
        self.ttft_s, self.gap_s, self.jitter, self.seed = ttft_s, gap_s, jitter, seed
        self.calls = 0

    def warmup(self, requests, concurrency) -> None:
        pass

    def run(self, requests, load, rng, on_done, max_requests=None):
        import numpy as np

        from tokenmill.bench.client import RequestRecord
        from tokenmill.bench.runner import RunOutcome

        draw = np.random.default_rng([self.seed, self.calls])
        self.calls += 1
        factor = 1.0 + self.jitter * float(draw.uniform(-1.0, 1.0))
        ttft, gap = self.ttft_s * factor, self.gap_s * factor
        slots = [0.0] * (load.concurrency or len(requests))
        records = []
        for i, req in enumerate(requests):
            k = min(range(len(slots)), key=slots.__getitem__)
            start = slots[k]
            r = RequestRecord(i, req.prompt_len, req.output_len, planned_time_s=start,
                              send_time_s=start)
            r.first_chunk_time_s = start + ttft
            r.chunk_times_s = [start + ttft + j * gap for j in range(req.output_len)]
            r.chunk_tokens = [1] * req.output_len
            r.chunk_texts = [" w"] * req.output_len
            r.usage_prompt_tokens, r.usage_completion_tokens = req.prompt_len, req.output_len
            r.client_output_tokens = req.output_len
            r.finish_reason = "length"
            r.end_time_s = r.chunk_times_s[-1]
            slots[k] = r.end_time_s
            records.append(r)
            on_done(r)
        return RunOutcome(records, max(r.end_time_s for r in records))
