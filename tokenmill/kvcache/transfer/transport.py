"""ZMQ over TCP: the producer's ROUTER socket, served from a thread, and the
consumer's `Puller`, which keeps its DEALER connections to each producer open between
pulls (a new connection a pull cost a TCP handshake and ZMQ's greeting every time).

The interface a device-to-device transport (NCCL, NIXL) would implement is the pair
`BlockServer` (answer pulls and releases by request id) and `Puller` (fetch a request's
blocks into a host payload; tell a producer a pull will never come); the engine-side
books (pins, installs) do not depend on how bytes move.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np
import zmq

from tokenmill.kvcache.transfer.wire import (
    KVLayout,
    Message,
    PullReply,
    PullRequest,
    Release,
    Released,
    decoder,
    encoder,
    frame_groups,
)

logger = logging.getLogger(__name__)

# answers one message: (the reply header, the payload to send after it, or None). Its
# second argument gives a writable staging buffer of n bytes for the payload.
Handler = Callable[[Message, Callable[[int], np.ndarray]], tuple[Message, np.ndarray | None]]

_REUSE_MAX_BYTES = 64 << 20  # a bigger payload gets a fresh buffer, not a kept one
_IDLE_PER_PEER = 4  # kept connections to one producer (the consumer's pull threads)


class TransferError(RuntimeError):
    """A pull failed: the reason names the field (layout, request, frame) at fault."""


class BlockServer:
    """A ROUTER socket bound at tcp://host:port (port None: a free one), answering
    messages with `handler` on its own thread until `close`. Payloads go out without a
    copy (ZMQ reads the staging buffer itself), so the buffer is reused only once ZMQ
    reports the last send done: a producer's repeated pulls do not fault in fresh pages."""

    def __init__(self, ctx: zmq.Context, host: str, port: int | None, handler: Handler) -> None:
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
            else:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(f"kv-transfer-config: cannot listen on {host}:{port or 'any'} "
                             f"(kv_ip / kv_port): {e}") from None
        self._handler = handler
        self._staging = np.empty(0, dtype=np.uint8)
        self._sending: zmq.MessageTracker | None = None
        self.num_messages = 0  # answered, any kind
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-transfer-server",
                                        daemon=True)
        self._thread.start()

    def _buffer(self, nbytes: int) -> np.ndarray:
        """A staging buffer of at least nbytes that no send in flight reads."""
        if (self._sending is None or self._sending.done) and self._staging.nbytes >= nbytes:
            return self._staging
        buf = np.empty(nbytes, dtype=np.uint8)
        if nbytes <= _REUSE_MAX_BYTES:
            self._staging = buf
        return buf

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, *parts = self._sock.recv_multipart()
            try:
                msg = decoder.decode(parts[0]) if len(parts) == 1 else None
            except Exception:  # noqa: BLE001 - a malformed message must not end the server
                msg = None
            payload = None
            if not isinstance(msg, PullRequest | Release):
                reply = PullReply("", error="malformed message (expected a pull or a release)")
            else:
                try:
                    reply, payload = self._handler(msg, self._buffer)
                except Exception as e:
                    logger.exception("KV transfer message for %s failed", msg.request_id)
                    reply = PullReply(msg.request_id, error=f"producer error: {e}")
            if payload is None:
                self._sock.send_multipart([ident, encoder.encode(reply)])
            else:
                self._send_payload(ident, reply, payload)
            self.num_messages += 1

    def _send_payload(self, ident: bytes, reply: PullReply, payload: np.ndarray) -> None:
        """The header, then the payload in frames of whole segments (wire.frame_groups),
        each a view of the staging buffer sent without a copy."""
        reply.frame_segments = frame_groups(reply.segment_bytes)
        self._sock.send_multipart([ident, encoder.encode(reply)], zmq.SNDMORE)
        trackers = []
        at = seg = 0
        for i, count in enumerate(reply.frame_segments):
            size = sum(reply.segment_bytes[seg:seg + count])
            last = i == len(reply.frame_segments) - 1
            trackers.append(self._sock.send(payload[at:at + size], 0 if last else zmq.SNDMORE,
                                            copy=False, track=True))
            at, seg = at + size, seg + count
        if payload.base is self._staging or payload is self._staging:
            self._sending = zmq.MessageTracker(*trackers)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


class Puller:
    """The consumer's side: one kept DEALER connection per producer and pull thread.
    Thread-safe; a connection is used by one thread at a time and dropped, not kept,
    after a timeout (a late reply would answer the next message on it)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[zmq.Socket]] = {}
        self._closed = False
        self.num_connects = 0

    def pull(self, host: str, port: int, request: PullRequest, timeout_s: float,
             expect_sizes: list[int], layout: KVLayout) -> tuple[PullReply, list]:
        """Fetch a request's blocks: the reply and its segments (one bytes-like view per
        pool tensor), checked against this engine's layout and the segment sizes its pool
        expects. Raises TransferError."""
        reply, parts = self._ask(host, port, request, timeout_s)
        if not isinstance(reply, PullReply):
            raise TransferError("malformed reply from the producer (not a PullReply)")
        if reply.error is not None:
            raise TransferError(reply.error)
        if reply.layout != layout:
            raise TransferError("the producer's reply carries a different KV layout")
        if reply.segment_bytes != expect_sizes or len(parts) != len(reply.frame_segments) \
                or sum(reply.frame_segments) != len(expect_sizes):
            raise TransferError(f"truncated transfer: {len(parts)} payload frames holding "
                                f"{reply.frame_segments} segments of {reply.segment_bytes} "
                                f"bytes, expected segments of {expect_sizes}")
        segments = []
        for i, (part, count) in enumerate(zip(parts, reply.frame_segments)):
            frame = part.buffer
            sizes = expect_sizes[len(segments):len(segments) + count]
            if frame.nbytes != sum(sizes):
                raise TransferError(f"truncated transfer: frame {i} has {frame.nbytes} "
                                    f"bytes, expected {sum(sizes)}")
            at = 0
            for size in sizes:
                segments.append(frame[at:at + size])
                at += size
        return reply, segments

    def release(self, host: str, port: int, request_id: str, timeout_s: float) -> bool:
        """Tell the producer its pin of request_id will never be pulled; True if it held
        one. Raises TransferError (the producer is gone: its pins went with it)."""
        reply, _ = self._ask(host, port, Release(request_id), timeout_s)
        if not isinstance(reply, Released):
            raise TransferError(f"malformed reply to a release: {reply!r}")
        return reply.freed

    def _ask(self, host: str, port: int, msg: Message, timeout_s: float) -> tuple[Message, list]:
        """One message and its reply over a kept connection: (reply header, the frames
        after it)."""
        peer = (host, port)
        sock = self._checkout(peer)
        keep = False
        try:
            sock.send(encoder.encode(msg))
            if not sock.poll(int(timeout_s * 1000)):
                raise TransferError(f"no reply from the producer at {host}:{port} within "
                                    f"{timeout_s:g} s")
            parts = sock.recv_multipart(copy=False)
            keep = True
        finally:
            self._checkin(peer, sock, keep)
        try:
            reply = decoder.decode(parts[0].buffer)
        except Exception as e:  # noqa: BLE001
            raise TransferError(f"malformed reply header from the producer: {e}") from None
        if getattr(reply, "request_id", None) not in (msg.request_id, ""):
            raise TransferError(f"the producer answered for request {reply.request_id!r}, "
                                f"not {msg.request_id!r}")
        return reply, parts[1:]

    def _checkout(self, peer: tuple[str, int]) -> zmq.Socket:
        with self._lock:
            idle = self._idle.get(peer)
            if idle:
                return idle.pop()
            self.num_connects += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{peer[0]}:{peer[1]}")
        return sock

    def _checkin(self, peer: tuple[str, int], sock: zmq.Socket, keep: bool) -> None:
        with self._lock:
            idle = self._idle.setdefault(peer, [])
            if keep and not self._closed and len(idle) < _IDLE_PER_PEER:
                idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        """Close the kept connections (a pull in flight closes its own when it ends)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for s in socks:
                s.close()
