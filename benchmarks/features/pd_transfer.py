"""KV transfer over loopback (issue 62): GB/s and ms per 1,000 tokens of KV pulled
through tokenmill's ZMQ connector, against a plain TCP socket copy of the same bytes.

The pool has the embedded SmolLM2's shape (30 layers, 3 KV heads, head_dim 64, 16-token
blocks) in bf16 and in int8 (+ fp32 scales); a producer pins the blocks of one
N-token prompt and a consumer pulls them (layout handshake, a few large frames, size
checks) and copies them into its own pool, as a decode instance does, over the
connection it keeps to the producer (the first pull, which opens it, is not counted). No
model is loaded. The
socket copy sends the same number of bytes once over a loopback TCP connection
(sendall / recv_into a preallocated buffer): the floor the connector is held to.

    python -m benchmarks run pd-transfer                     # 64, 1k, 4k, 16k tokens, ~1 min
    python -m benchmarks run pd-transfer --tokens 64 --repeats 2 --no-result   # smoke

The figures go to benchmarks/results/ (--no-result skips it): each size's connector ms
and the socket copy's, the ratio in the notes (the socket copy is the floor, not a peer
engine).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import torch
import zmq

from benchmarks import results
from benchmarks.common import machine
from benchmarks.results import Figure
from tokenmill.attention.kv_quant import kv_format
from tokenmill.attention.quantized import QuantizedPool
from tokenmill.kvcache.block_manager import BlockManager
from tokenmill.kvcache.transfer.producer import KVProducer
from tokenmill.kvcache.transfer.transport import BlockServer, Puller
from tokenmill.kvcache.transfer.wire import (
    PullRequest,
    layout_of,
    scatter_blocks,
    segment_sizes,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def _pool(num_blocks: int, kv: str) -> list:
    shape = (HEADS, num_blocks, BLOCK, HEAD_DIM)
    if kv == "bf16":
        return [(torch.randn(shape).to(torch.bfloat16), torch.randn(shape).to(torch.bfloat16))
                for _ in range(LAYERS)]
    fmt = kv_format("int8")
    pools = []
    for _ in range(LAYERS):
        pair = []
        for _ in range(2):
            p = QuantizedPool.allocate(fmt, shape, torch.device("cpu"), torch.zeros)
            p.data.copy_(torch.randint(-127, 127, shape, dtype=torch.int8))
            p.scale.copy_(torch.rand(shape[:3]))
            pair.append(p)
        pools.append(tuple(pair))
    return pools


def connector_ms(num_tokens: int, kv: str, repeats: int) -> tuple[list[float], int]:
    """The ms of each pull + install of `num_tokens` tokens' KV, and its bytes."""
    nb = -(-num_tokens // BLOCK)
    src, dst = _pool(nb + 1, kv), _pool(nb + 1, kv)
    layout = layout_of(src, BLOCK, 1)
    bm = BlockManager(nb + 1, BLOCK, enable_prefix_caching=False)
    producer = KVProducer(bm, src, 1, layout, pin_timeout_s=600)
    ctx = zmq.Context()
    server = BlockServer(ctx, "127.0.0.1", None, producer.serve)
    sizes = segment_sizes(dst, nb, 1)
    puller = Puller(ctx)
    times = []
    try:
        for i in range(repeats + 1):
            seq = Sequence(f"r{i}", list(range(num_tokens)), SamplingParams())
            bm.allocate_slots(seq, num_tokens)
            assert seq.block_table[:nb] == list(range(nb))
            producer.pin(seq.request_id, seq.block_table[:nb], seq.prompt_token_ids)
            bm.free(seq)
            t0 = time.perf_counter()
            _, segments = puller.pull("127.0.0.1", server.port,
                                     PullRequest(f"r{i}", list(range(nb)), layout), 30, sizes,
                                     layout)
            scatter_blocks(dst, list(range(nb)), 1, segments)
            del segments  # the receive buffers go before the next pull, as in a consumer
            if i:  # the first opened the connection
                times.append((time.perf_counter() - t0) * 1e3)
            producer.release_finished()
        first = (lambda pool: pool[0][0] if kv == "bf16" else pool[0][0].data)
        assert torch.equal(first(dst)[:, :nb], first(src)[:, :nb]), "the copy differs"
    finally:
        puller.close()
        server.close()
        ctx.term()
    return times, sum(sizes)


def socket_ms(num_bytes: int, repeats: int) -> list[float]:
    """The ms of each send of `num_bytes` over a loopback TCP connection into a buffer."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    payload = bytes(num_bytes)
    buf = bytearray(num_bytes)
    times = []

    def send() -> None:
        conn, _ = listener.accept()
        with conn:
            for _ in range(repeats):
                conn.recv(1)
                conn.sendall(payload)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        view = memoryview(buf)
        for _ in range(repeats):
            t0 = time.perf_counter()
            c.sendall(b"x")
            got = 0
            while got < num_bytes:
                got += c.recv_into(view[got:])
            times.append((time.perf_counter() - t0) * 1e3)
    t.join(5)
    listener.close()
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 1000, 4000, 16000])
    ap.add_argument("--kv", nargs="+", default=["bf16", "int8"], choices=["bf16", "int8"])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--no-result", action="store_true",
                    help="do not write the result to benchmarks/results/")
    args = ap.parse_args(argv)
    print(f"KV transfer over loopback · {machine()} · torch {torch.__version__}")
    print("kv    tokens      MB   connector ms  GB/s  ms/1k tok   socket ms  GB/s   ratio")
    figures, notes = [], []
    for kv in args.kv:
        for n in args.tokens:
            ms_runs, nbytes = connector_ms(n, kv, args.repeats)
            sock_runs = socket_ms(nbytes, args.repeats)
            ms, sock = statistics.median(ms_runs), statistics.median(sock_runs)
            print(f"{kv:5s} {n:6d} {nbytes / 1e6:7.1f} {ms:12.2f} {nbytes / ms / 1e6:5.2f} "
                  f"{ms * 1000 / n:10.2f} {sock:11.2f} {nbytes / sock / 1e6:5.2f} "
                  f"{ms / sock:6.2f}x", flush=True)
            config = {"kv": kv, "tokens": n, "bytes": nbytes}
            figures += [Figure(f"connector pull + install, {kv}, {n} tokens", "tokenmill",
                               f"pull {kv} {n} tokens", "ms", ms_runs, False, config),
                        Figure(f"plain socket copy, {kv}, {n} tokens", "tokenmill",
                               f"socket {kv} {n} tokens", "ms", sock_runs, False, config)]
            notes.append(f"{kv} {n} tokens ({nbytes / 1e6:.1f} MB): connector {ms:.2f} ms "
                         f"= {ms / sock:.2f}x the socket copy's {sock:.2f} ms")
    if not args.no_result:
        print(results.write(results.build("pd-transfer", "PD KV transfer over loopback",
                                          figures, notes=notes)))


if __name__ == "__main__":
    main()
