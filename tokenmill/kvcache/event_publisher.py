"""Publishes KV-cache event batches on a ZMQ PUB socket, as vLLM does.

Configured by vLLM's `--kv-events-config` JSON, e.g.
`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"topic": ""}`. Each batch goes out as three frames: the topic, an 8-byte
big-endian sequence number (0, 1, 2, ... per publisher) and the msgpack
`KVEventBatch`. With `replay_endpoint`, a ROUTER socket answers a request
carrying a start sequence number (8 bytes, big-endian) with every buffered
batch from there on, as `(seq, payload)` frames, then `(-1, b"")`.

The PUB socket is used only by the engine loop that publishes (a send never
blocks: past the high-water mark ZMQ drops); the replay socket only by its own
thread; the buffer between them is guarded by a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import msgspec
import zmq

from tokenmill.config import KVEventsConfig
from tokenmill.kvcache.events import KVCacheEvent, KVEventBatch

log = logging.getLogger("tokenmill.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _binds(endpoint: str) -> bool:
    # vLLM's rule: a wildcard or a local transport binds, a host address connects
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self._ctx = zmq.Context.instance()
        self._topic = config.topic.encode()
        self._rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
        self._running = True
        self._replay_thread: threading.Thread | None = None
        if config.replay_endpoint:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.bind(config.replay_endpoint)
            self._replay_thread = threading.Thread(target=self._serve_replay, args=(replay,),
                                                   name="kv-events-replay", daemon=True)
            self._replay_thread.start()
        log.info("publishing KV events on %s%s", config.endpoint,
                 f" (replay on {config.replay_endpoint})" if config.replay_endpoint else "")

    def publish(self, events: list[KVCacheEvent]) -> None:
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank)
        payload = self._encoder.encode(batch)
        seq = self._seq
        self._seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                     flags=zmq.NOBLOCK)
        except zmq.Again:  # no subscriber keeps up: dropped, still replayable
            pass

    def _serve_replay(self, sock: zmq.Socket) -> None:
        try:
            while self._running:
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3:
                    log.warning("ignoring a malformed KV-event replay request")
                    continue
                client, _, start = frames
                start_seq = int.from_bytes(start, "big")
                with self._lock:
                    wanted = [(s, p) for s, p in self._buffer if s >= start_seq]
                for s, p in wanted:
                    sock.send_multipart((client, b"", s.to_bytes(8, "big"), p))
                sock.send_multipart((client, b"", END_SEQ, b""))
        finally:
            sock.close(linger=0)

    def shutdown(self) -> None:
        self._running = False
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        self._pub.close(linger=200)
