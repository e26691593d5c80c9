"""Structured output overhead: `tokenmill serve` with a JSON schema vs unconstrained.

Streams /v1/chat/completions at concurrency 1 and 16 (N requests per level), once
unconstrained and once with `response_format` json_schema (the same schema, so it
is compiled once and cached), and reports TTFT p50 and TPOT mean per level. Then
the compile cost: TTFT of the first request with a never-seen schema vs the same
schema again (cached). Targets (issue 16): TPOT overhead <= 10% at c=16; a cached
schema adds <= 20 ms TTFT.

    .venv/bin/python benchmarks/structured_output.py            # the real run
    .venv/bin/python benchmarks/structured_output.py --num-requests 2 --concurrency 1 \\
        --max-tokens 8                                          # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import machine
from serving import start_server

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "maxLength": 60},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
    "address": {"type": "object", "properties": {
        "street": {"type": "string", "maxLength": 60}, "city": {"type": "string",
                                                                "maxLength": 40}},
        "required": ["street", "city"]}},
    "required": ["name", "age", "email", "tags", "address"]}
PROMPT = "Invent a customer record with a name, age, email, tags and an address, as JSON."


async def one(client: httpx.AsyncClient, body: dict) -> tuple[float, float | None]:
    """(TTFT s, TPOT s or None) of one streamed request."""
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif first is None and event["choices"] and event["choices"][0]["delta"].get(
                    "content"):
                first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    tpot = (end - first) / (tokens - 1) if tokens > 1 else None
    return first - start, tpot


def body(max_tokens: int, schema: dict | None) -> dict:
    b = {"model": "smollm2-135m", "messages": [{"role": "user", "content": PROMPT}],
         "max_tokens": max_tokens, "temperature": 1.0, "stream": True,
         "stream_options": {"include_usage": True}}
    if schema is not None:
        b["response_format"] = {"type": "json_schema",
                                "json_schema": {"name": "record", "schema": schema}}
    return b


async def level(base_url: str, concurrency: int, num_requests: int, max_tokens: int,
                schema: dict | None) -> tuple[float, float]:
    """TTFT p50 (ms) and TPOT mean (ms) of num_requests at this concurrency."""
    results: list[tuple[float, float | None]] = []
    queue = list(range(num_requests))
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        async def worker() -> None:
            while queue:
                queue.pop()
                results.append(await one(client, body(max_tokens, schema)))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    ttft = statistics.median(t for t, _ in results) * 1e3
    tpots = [t for _, t in results if t is not None]
    return ttft, (statistics.mean(tpots) * 1e3 if tpots else float("nan"))


async def compile_cost(base_url: str, max_tokens: int) -> tuple[float, float]:
    """TTFT (ms) of a never-seen schema, then of the same schema again."""
    fresh = json.loads(json.dumps(SCHEMA))
    fresh["properties"][f"x{uuid.uuid4().hex[:8]}"] = {"type": "boolean"}  # a new cache key
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        first, _ = await one(client, body(max_tokens, fresh))
        cached, _ = await one(client, body(max_tokens, fresh))
    return first * 1e3, cached * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,16", help="comma-separated levels")
    ap.add_argument("--num-requests", type=int, default=32, help="requests per level and mode")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("serve_args", nargs="*", help="extra `tokenmill serve` flags (after --)")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    print(f"structured output · {machine()}")
    server = start_server("smollm2-135m", "--max-num-seqs", str(max(levels)), *args.serve_args)
    try:
        url = server.base_url
        asyncio.run(level(url, 1, 1, 8, SCHEMA))  # warm-up; compiles SCHEMA once
        print(f"{'c':>3} {'mode':>13} {'TTFT p50 ms':>12} {'TPOT ms':>9} {'TPOT overhead':>14}")
        for c in levels:
            base_ttft, base_tpot = asyncio.run(level(url, c, args.num_requests,
                                                     args.max_tokens, None))
            ttft, tpot = asyncio.run(level(url, c, args.num_requests, args.max_tokens, SCHEMA))
            print(f"{c:>3} {'unconstrained':>13} {base_ttft:>12.1f} {base_tpot:>9.2f}")
            print(f"{c:>3} {'json_schema':>13} {ttft:>12.1f} {tpot:>9.2f} "
                  f"{(tpot / base_tpot - 1) * 100:>13.1f}%")
        first, cached = asyncio.run(compile_cost(url, args.max_tokens))
        print(f"TTFT with a new schema {first:.1f} ms (compile included), "
              f"the same schema again {cached:.1f} ms (cached)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
