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
from starlette.responses import JSONResponse, StreamingResponse
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


async def _stream(body: dict, chat: bool):
    """Role chunk (chat), then `max_tokens` words in chunks of `chunk_tokens`, one chunk
    every `gap_ms` after a first delay of `ttft_ms`; usage; [DONE]."""
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
    await asyncio.sleep(fake.get("ttft_ms", 50) / 1000)
    sent = chunks = 0
    while sent < n:
        k = min(per_chunk, n - sent)
        if chunks:
            await asyncio.sleep(fake.get("gap_ms", 10) / 1000)
        if die_after is not None and chunks >= die_after:
            raise RuntimeError("fake server dies mid-stream")
        yield chunk(" w" * k)
        sent += k
        chunks += 1
    yield chunk("", finish="length")
    prompt = body.get("prompt") or body["messages"][0]["content"]
    usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n + usage_delta,
             "total_tokens": len(prompt.split()) + n + usage_delta}
    yield "data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\n"
    yield "data: [DONE]\n\n"


async def completions(request: Request):
    body = await request.json()
    fake = body.get("fake") or {}
    if fake.get("reject") and fake["reject"] in body:  # a strict server: unknown field
        return JSONResponse({"error": {"message": f"Unrecognized request argument supplied: "
                                                  f"{fake['reject']}", "param": fake["reject"]}},
                            status_code=400)
    if fake.get("status"):
        return JSONResponse({"error": {"message": "nope"}}, status_code=body["fake"]["status"])
    return StreamingResponse(_stream(body, chat=False), media_type="text/event-stream")


async def chat(request: Request):
    body = await request.json()
    return StreamingResponse(_stream(body, chat=True), media_type="text/event-stream")


async def models(request: Request):
    return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})


class FakeServer:
    def __init__(self) -> None:
        app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                                Route("/v1/chat/completions", chat, methods=["POST"]),
                                Route("/v1/models", models)])
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

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
