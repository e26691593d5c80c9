"""Structured output overhead: `tokenmill serve` with a JSON schema vs unconstrained.

Streams /v1/chat/completions at concurrency 1 and 16 (N requests per level), once
with `response_format` json_schema (the same schema, so it is compiled once and
cached) and once unconstrained with the same completion lengths (each request
`ignore_eos` with min_tokens = max_tokens = the length a schema request produced:
a JSON document ends when the schema does, and shorter requests mean more prefills
per decoded token, which alone would raise TPOT), and reports TTFT p50 and TPOT
mean per level. Then
the compile cost: TTFT of the first request with a never-seen schema vs the same
schema again (cached). Targets (issue 16): TPOT overhead <= 10% at c=16; a cached
schema adds <= 20 ms TTFT.

    python -m benchmarks run structured-output            # the real run
    python -m benchmarks run structured-output --num-requests 2 --concurrency 1 \\
        --max-tokens 8                                          # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

import httpx

from benchmarks import results
from benchmarks.common import machine
from benchmarks.results import Figure
from benchmarks.server import start_server

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


async def one(client: httpx.AsyncClient, body: dict) -> tuple[float, float | None, int]:
    """(TTFT s, TPOT s or None, completion tokens) of one streamed request."""
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
    return first - start, tpot, tokens


def body(max_tokens: int, schema: dict | None, exact: int | None = None) -> dict:
    """exact: an unconstrained request of exactly this many tokens (ignore_eos)."""
    b = {"model": "smollm2-135m", "messages": [{"role": "user", "content": PROMPT}],
         "max_tokens": exact or max_tokens, "temperature": 1.0, "stream": True,
         "stream_options": {"include_usage": True}}
    if exact:
        b.update(min_tokens=exact, ignore_eos=True)
    if schema is not None:
        b["response_format"] = {"type": "json_schema",
                                "json_schema": {"name": "record", "schema": schema}}
    return b


async def level(base_url: str, concurrency: int, num_requests: int, max_tokens: int,
                schema: dict | None, lengths: list[int] | None = None
                ) -> tuple[float, float, list[int]]:
    """TTFT p50 (ms), TPOT mean (ms) and the completion lengths of num_requests at this
    concurrency. lengths: unconstrained requests of exactly these lengths, in order."""
    results: list[tuple[float, float | None, int]] = []
    queue = list(reversed(lengths)) if lengths else [None] * num_requests
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        async def worker() -> None:
            while queue:
                exact = queue.pop()
                results.append(await one(client, body(max_tokens, schema, exact)))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    ttft = statistics.median(r[0] for r in results) * 1e3
    tpots = [r[1] for r in results if r[1] is not None]
    return ttft, (statistics.mean(tpots) * 1e3 if tpots else float("nan")), \
        [r[2] for r in results]


async def compile_cost(base_url: str, max_tokens: int) -> tuple[float, float]:
    """TTFT (ms) of a never-seen schema, then of the same schema again."""
    fresh = json.loads(json.dumps(SCHEMA))
    fresh["properties"][f"x{uuid.uuid4().hex[:8]}"] = {"type": "boolean"}  # a new cache key
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        first, _, _ = await one(client, body(max_tokens, fresh))
        cached, _, _ = await one(client, body(max_tokens, fresh))
    return first * 1e3, cached * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,16", help="comma-separated levels")
    ap.add_argument("--num-requests", type=int, default=32, help="requests per level and mode")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="schema/baseline pairs per level")
    ap.add_argument("--no-result", action="store_true",
                    help="print only; write no benchmarks/results/ file")
    ap.add_argument("serve_args", nargs="*", help="extra `tokenmill serve` flags (after --)")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    print(f"structured output · {machine()}")
    server = start_server("smollm2-135m", "--max-num-seqs", str(max(levels)), *args.serve_args)
    tpots: dict[tuple[int, str], list[float]] = {}
    try:
        url = server.base_url
        asyncio.run(level(url, 1, 1, 8, SCHEMA))  # warm-up; compiles SCHEMA once
        print(f"{'c':>3} {'mode':>22} {'tokens':>7} {'TTFT p50 ms':>12} {'TPOT ms':>9} "
              f"{'TPOT overhead':>14}")
        for c in levels:
            for _ in range(args.repeats):
                ttft, tpot, lengths = asyncio.run(level(url, c, args.num_requests,
                                                        args.max_tokens, SCHEMA))
                # the baseline generates exactly the lengths the schema run did, so both
                # runs see the same batch sizes and the same prefills per decoded token
                base_ttft, base_tpot, _ = asyncio.run(level(
                    url, c, len(lengths), args.max_tokens, None, lengths))
                tpots.setdefault((c, "unconstrained (matched lengths)"), []).append(base_tpot)
                tpots.setdefault((c, "json_schema"), []).append(tpot)
                mean_len = statistics.mean(lengths)
                print(f"{c:>3} {'unconstrained (matched)':>22} {mean_len:>7.1f} "
                      f"{base_ttft:>12.1f} {base_tpot:>9.2f}")
                print(f"{c:>3} {'json_schema':>22} {mean_len:>7.1f} {ttft:>12.1f} {tpot:>9.2f} "
                      f"{(tpot / base_tpot - 1) * 100:>13.1f}%")
        first, cached = asyncio.run(compile_cost(url, args.max_tokens))
        print(f"TTFT with a new schema {first:.1f} ms (compile included), "
              f"the same schema again {cached:.1f} ms (cached)")
    finally:
        server.stop()
    if not args.no_result:
        cfg = {"model": "smollm2-135m", "requests": args.num_requests,
               "max_tokens": args.max_tokens}
        figures = [Figure(f"{mode}, c={c}", "tokenmill", f"TPOT c={c}", "ms", runs, False,
                          {**cfg, "concurrency": c, "mode": mode})
                   for (c, mode), runs in sorted(tpots.items())]
        figures += [Figure("a new schema (compile included)", "tokenmill", "TTFT", "ms",
                           [first], False, cfg),
                    Figure("the same schema again (cached)", "tokenmill", "TTFT", "ms",
                           [cached], False, cfg)]
        results.write(results.build("structured-output", "Structured output overhead",
                                    figures))


if __name__ == "__main__":
    main()
