"""ZMQ over TCP: the producer's ROUTER socket, served from a thread, and the
consumer's pull (one DEALER socket per pull, from a small thread pool).

The interface a device-to-device transport (NCCL, NIXL) would implement is the pair
`BlockServer` (serve pinned blocks by request id) and `pull` (fetch them into host
frames); the engine-side books (pins, installs) do not depend on how bytes move.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from tokenmill.kvcache.transfer.wire import KVLayout, PullReply, PullRequest, decoder, encoder

logger = logging.getLogger(__name__)

# answers a pull: (the reply header, the frames to send after it)
Handler = Callable[[PullRequest], tuple[PullReply, list]]


class TransferError(RuntimeError):
    """A pull failed: the reason names the field (layout, request, frame) at fault."""


class BlockServer:
    """A ROUTER socket bound at tcp://host:port (port None: a free one), answering
    pulls with `handler` on its own thread until `close`."""

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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-transfer-server",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, *parts = self._sock.recv_multipart()
            try:
                msg = decoder.decode(parts[0]) if len(parts) == 1 else None
            except Exception:  # noqa: BLE001 - a malformed pull must not end the server
                msg = None
            if not isinstance(msg, PullRequest):
                reply, frames = PullReply("", error="malformed pull request"), []
            else:
                try:
                    reply, frames = self._handler(msg)
                except Exception as e:
                    logger.exception("KV pull for %s failed", msg.request_id)
                    reply, frames = PullReply(msg.request_id, error=f"producer error: {e}"), []
            self._sock.send_multipart([ident, encoder.encode(reply), *frames], copy=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


def pull(ctx: zmq.Context, host: str, port: int, request: PullRequest, timeout_s: float,
         expect_sizes: list[int], layout: KVLayout) -> tuple[PullReply, list]:
    """Fetch a request's blocks: the reply and its frames (bytes-like), checked against
    this engine's layout and the sizes its pool expects. Raises TransferError."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(encoder.encode(request))
        if not sock.poll(int(timeout_s * 1000)):
            raise TransferError(f"no reply from the producer at {host}:{port} within "
                                f"{timeout_s:g} s")
        parts = sock.recv_multipart(copy=False)
    finally:
        sock.close()
    try:
        reply = decoder.decode(parts[0].buffer)
    except Exception as e:  # noqa: BLE001
        raise TransferError(f"malformed reply header from the producer: {e}") from None
    if not isinstance(reply, PullReply):
        raise TransferError("malformed reply from the producer (not a PullReply)")
    if reply.error is not None:
        raise TransferError(reply.error)
    if reply.layout != layout:
        raise TransferError("the producer's reply carries a different KV layout")
    frames = [p.buffer for p in parts[1:]]
    if len(frames) != len(expect_sizes) or reply.frame_bytes != expect_sizes:
        raise TransferError(f"truncated transfer: {len(frames)} frames announced as "
                            f"{reply.frame_bytes}, expected {len(expect_sizes)} of "
                            f"{expect_sizes}")
    for i, (frame, size) in enumerate(zip(frames, expect_sizes)):
        if frame.nbytes != size:
            raise TransferError(f"truncated transfer: frame {i} has {frame.nbytes} bytes, "
                                f"expected {size}")
    return reply, frames
