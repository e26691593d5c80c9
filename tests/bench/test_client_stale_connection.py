"""A server that closes its idle kept-alive connections without saying so (llama-server
does: W2 against `llama-server -np 16` lost 10-13 of 64 requests as "disconnected" with
"Can not write request body"): the bench resends a request that never reached the
server, and counts no failure the server did not make."""

from __future__ import annotations

import asyncio
import json

from tokenmill.bench.client import ClientOptions, OpenAIClient, RequestRecord


async def _serve_one_response_per_connection(reader, writer) -> None:
    """Answer the first request on a connection as a kept-alive SSE stream (no
    Connection: close); drop the connection when a second request arrives on it, without
    a byte of response — a server that had closed it while idle, as the client sees it."""
    for served in range(2):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            break
        if served:  # the reused connection: gone before it answered
            break
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        chunks = [{"choices": [{"index": 0, "text": w, "finish_reason": None}]}
                  for w in "abc"]
        chunks[-1]["choices"][0]["finish_reason"] = "length"
        body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
        body += b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
    writer.close()


def test_a_connection_the_server_closed_while_idle_costs_no_request():
    records = asyncio.run(_run_after_a_burst(0, 6))  # one after another: each reuses one
    assert [r.error_kind for r in records] == [None] * 6
    assert all(len(r.chunk_times_s) == 3 for r in records)


async def _run_after_a_burst(burst: int, n: int) -> list[RequestRecord]:
    """`burst` requests at once (a connection each, all left idle in the pool and dead
    to the server), then n one after another: the first of those meets every dead one."""
    server = await asyncio.start_server(_serve_one_response_per_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = OpenAIClient(ClientOptions(base_url=f"http://127.0.0.1:{port}", model="m",
                                        ignore_eos=False))
    try:
        first = [RequestRecord(request_id=i, prompt_len=None, max_tokens=3)
                 for i in range(burst)]
        await asyncio.gather(*(client.send(r, "hello", 0.0) for r in first))
        records = list(first)
        for i in range(n):
            record = RequestRecord(request_id=burst + i, prompt_len=None, max_tokens=3)
            records.append(await client.send(record, "hello", 0.0))
    finally:
        await client.aclose()
        server.close()
    return records


def test_more_dead_connections_than_retries_cost_no_request():
    """W2 against llama-server -np 16 lost a request after five dead connections in a
    row (more than the bench's retries): a resend goes out on a new connection."""
    records = asyncio.run(_run_after_a_burst(12, 3))
    assert [r.error_kind for r in records] == [None] * 15
    assert all(len(r.chunk_times_s) == 3 for r in records)
