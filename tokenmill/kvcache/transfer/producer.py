"""The prefill side: a finished request's prompt blocks pinned (a reference held in
the block manager) until a consumer pulls them, releases them (it will never pull: its
client left) or `pin_timeout_s` passes, served by the transport's thread. Pins are
taken and dropped on the engine thread only (the block manager is not thread-safe);
the server thread claims an entry, copies its bytes out and marks it done (or marks a
released one done), and the engine's next step drops the pin."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tokenmill.kvcache.block_manager import BlockManager
from tokenmill.kvcache.transfer.wire import (
    KVLayout,
    PullReply,
    PullRequest,
    Release,
    Released,
    describe_mismatch,
    gather_blocks,
    layout_mismatch,
    segment_sizes,
)

_pin_ids = itertools.count()


@dataclass
class PinnedKV:
    """One request's pinned blocks. Reads as a live sequence to check_integrity
    (seq_id, block_table, block_hashes, num_computed_tokens, token_ids, lora_int_id)."""

    request_id: str
    block_table: list[int]
    token_ids: list[int]  # the prompt
    deadline: float
    state: str = "pinned"  # -> "claimed" (being sent) -> "done"
    seq_id: str = field(default_factory=lambda: f"pin-{next(_pin_ids)}")
    block_hashes: list[int] = field(default_factory=list)
    lora_int_id: int = 0

    @property
    def num_computed_tokens(self) -> int:
        return len(self.token_ids)


class KVProducer:
    def __init__(self, block_manager: BlockManager, kv_caches: list, block_dim: int,
                 layout: KVLayout, pin_timeout_s: float) -> None:
        self.block_manager = block_manager
        self.kv_caches = kv_caches
        self.block_dim = block_dim
        self.layout = layout
        self.pin_timeout_s = pin_timeout_s
        self._lock = threading.Lock()
        self._entries: dict[str, PinnedKV] = {}
        self.num_expired = 0  # pins freed by the timeout, never pulled
        self.num_released = 0  # pins freed by a consumer's release, never pulled
        self.num_served = 0

    # ---- engine thread ----------------------------------------------------------

    def pin(self, request_id: str, block_ids: list[int], prompt: list[int]) -> None:
        self.block_manager.share(block_ids)
        entry = PinnedKV(request_id, list(block_ids), list(prompt),
                         time.monotonic() + self.pin_timeout_s)
        with self._lock:
            old = self._entries.pop(request_id, None)
            self._entries[request_id] = entry
        if old is not None:  # a request id reused before its first pin was pulled
            self.block_manager.release(old.block_table)

    def release_finished(self) -> None:
        """Drop the pins that were served or timed out (the engine calls it each step)."""
        now = time.monotonic()
        with self._lock:
            gone = [e for e in self._entries.values()
                    if e.state == "done" or (e.state == "pinned" and now > e.deadline)]
            for e in gone:
                del self._entries[e.request_id]
        for e in gone:
            self.num_expired += e.state == "pinned"
            self.block_manager.release(e.block_table)

    def holders(self) -> list[PinnedKV]:
        with self._lock:
            return list(self._entries.values())

    @property
    def busy(self) -> bool:
        return bool(self._entries)

    # ---- server thread ----------------------------------------------------------

    def serve(self, msg: PullRequest | Release,
              buffer: Callable[[int], np.ndarray]) -> tuple[PullReply | Released,
                                                            np.ndarray | None]:
        """Answer a pull (its blocks gathered into `buffer(n)`) or a release."""
        if isinstance(msg, Release):
            return self._release(msg), None
        return self._pull(msg, buffer)

    def _release(self, msg: Release) -> Released:
        with self._lock:
            entry = self._entries.get(msg.request_id)
            freed = entry is not None and entry.state == "pinned"
            if freed:
                entry.state = "done"  # the engine's next step drops the pin
                self.num_released += 1
        return Released(msg.request_id, freed)

    def _pull(self, req: PullRequest,
              buffer: Callable[[int], np.ndarray]) -> tuple[PullReply, np.ndarray | None]:
        mismatch = layout_mismatch(self.layout, req.layout)
        with self._lock:
            entry = self._entries.get(req.request_id)
            if entry is None or entry.state != "pinned":
                return PullReply(req.request_id, error=(
                    f"unknown request {req.request_id!r}: no pinned KV for it here (never "
                    "prefilled here, already pulled or released, or freed after the pin "
                    "timeout)"), field="remote_request_id"), None
            if mismatch is None and req.block_ids != entry.block_table:
                return PullReply(req.request_id, error=(
                    f"remote_block_ids {req.block_ids} are not request "
                    f"{req.request_id!r}'s blocks {entry.block_table}"),
                    field="remote_block_ids"), None
            # claimed: a refused layout frees the pin too, the consumer will not retry
            entry.state = "claimed" if mismatch is None else "done"
        if mismatch is not None:
            return PullReply(req.request_id, error=describe_mismatch(
                mismatch, self.layout, req.layout, "producer"), field=mismatch), None
        sizes = segment_sizes(self.kv_caches, len(entry.block_table), self.block_dim)
        try:
            payload = gather_blocks(self.kv_caches, entry.block_table, self.block_dim,
                                    buffer(sum(sizes)))
        finally:
            entry.state = "done"  # released by the engine's next step, sent or not
        self.num_served += 1
        return PullReply(req.request_id, layout=self.layout, num_tokens=len(entry.token_ids),
                         prompt_token_ids=entry.token_ids, segment_bytes=sizes), payload
