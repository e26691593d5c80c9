"""The decode side: pull a request's prompt KV from the producer named in its
kv_transfer_params (on a thread, so the engine keeps stepping), then, on the engine
thread, install it: fresh blocks from this engine's block manager, the bytes copied
in, the prompt counted as computed and its full blocks registered in the prefix cache
under their chained hashes, the producer's first token emitted as this request's first
output. A failed or late pull leaves nothing allocated: the request is prefilled here.
A request aborted before its blocks were pulled, or whose pull failed, sends the
producer a release (on its own thread, so a slow pull never delays it) so that its pin
goes now rather than at the producer's pin timeout."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import zmq

from tokenmill.kvcache.block_manager import BlockManager
from tokenmill.kvcache.transfer.transport import Puller, TransferError
from tokenmill.kvcache.transfer.wire import (
    KVLayout,
    PullReply,
    PullRequest,
    scatter_blocks,
    segment_sizes,
)
from tokenmill.sequence import Sequence, SequenceStatus


@dataclass
class RemotePrefill:
    """Where a request's prompt KV is (the producer's kv_transfer_params, checked)."""

    host: str
    port: int
    request_id: str
    block_ids: list[int]
    first_token_id: int
    first_logprobs: list | None  # [[token_id, logprob, rank], ...] for the first token


@dataclass
class Pending:
    seq: Sequence
    remote: RemotePrefill
    pulled: Future  # -> (PullReply, segments)

    @property
    def pulled_ok(self) -> bool:
        """The producer sent the blocks (and so has dropped its pin already)."""
        f = self.pulled
        return f.done() and not f.cancelled() and f.exception() is None


class KVConsumer:
    def __init__(self, ctx: zmq.Context, block_manager: BlockManager, kv_caches: list,
                 block_dim: int, layout: KVLayout, fresh: bytearray | None,
                 pull_timeout_s: float) -> None:
        self.ctx = ctx
        self.block_manager = block_manager
        self.kv_caches = kv_caches
        self.block_dim = block_dim
        self.layout = layout
        self.fresh = fresh  # the pool's never-zeroed marks: an installed block is written
        self.pull_timeout_s = pull_timeout_s
        self.release_timeout_s = min(pull_timeout_s, 2.0)
        self.puller = Puller(ctx)
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kv-transfer-pull")
        self._releases = ThreadPoolExecutor(1, thread_name_prefix="kv-transfer-release")

    def start(self, seq: Sequence, remote: RemotePrefill) -> Pending:
        sizes = segment_sizes(self.kv_caches, len(remote.block_ids), self.block_dim)
        request = PullRequest(remote.request_id, remote.block_ids, self.layout)
        future = self._pool.submit(self.puller.pull, remote.host, remote.port, request,
                                   self.pull_timeout_s, sizes, self.layout)
        return Pending(seq, remote, future)

    def release(self, pending: Pending) -> Future | None:
        """The producer's pin of a request this engine will not install goes now: the
        pull is cancelled if it has not started, and the producer told (a pull already
        served needs nothing). The Future says whether the producer held a pin."""
        pending.pulled.cancel()
        if pending.pulled_ok:
            return None
        remote = pending.remote
        return self._releases.submit(self._send_release, remote.host, remote.port,
                                     remote.request_id)

    def _send_release(self, host: str, port: int, request_id: str) -> bool:
        try:
            return self.puller.release(host, port, request_id, self.release_timeout_s)
        except TransferError:  # the producer is gone, and its pins with it
            return False

    def drain_releases(self) -> None:
        """Wait until every release asked so far has had its answer."""
        self._releases.submit(lambda: None).result()

    def check(self, pending: Pending) -> tuple[PullReply, list]:
        """The pulled reply, checked against the request; raises TransferError."""
        reply, segments = pending.pulled.result()
        seq = pending.seq
        if reply.prompt_token_ids != seq.prompt_token_ids:
            raise TransferError(f"the producer's KV is for a different prompt "
                                f"({reply.num_tokens} tokens, this request has "
                                f"{seq.num_prompt_tokens}): remote_request_id names another "
                                "request, or the two instances tokenize differently")
        if len(pending.remote.block_ids) != self.block_manager.num_blocks_for(reply.num_tokens):
            raise TransferError(f"remote_block_ids has {len(pending.remote.block_ids)} blocks "
                                f"for {reply.num_tokens} tokens")
        return reply, segments

    def can_install(self, seq: Sequence) -> bool:
        return self.block_manager.can_allocate_slots(seq, seq.num_prompt_tokens)

    def install(self, seq: Sequence, segments: list) -> None:
        """Blocks for the prompt (check `can_install` first), the pulled bytes in them."""
        bm = self.block_manager
        if not bm.allocate_slots(seq, seq.num_prompt_tokens):
            raise AssertionError("install without room: check can_install first")
        blocks = seq.block_table[:bm.num_blocks_for(seq.num_prompt_tokens)]
        scatter_blocks(self.kv_caches, blocks, self.block_dim, segments)
        if self.fresh is not None:
            # written whole: a step must not zero them now (one store, not a loop)
            np.frombuffer(self.fresh, dtype=np.uint8)[np.asarray(blocks, dtype=np.intp)] = 0
        seq.num_computed_tokens = seq.num_prompt_tokens
        bm.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        seq.first_scheduled_time = time.monotonic()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._releases.shutdown(wait=True)  # each waits at most release_timeout_s
        self.puller.close()
