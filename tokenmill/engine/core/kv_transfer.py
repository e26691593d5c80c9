"""KVTransferConnector: the engine's side of prefill/decode disaggregation.

vLLM's pull model, as vllm-router's --vllm-pd-disaggregation drives it: the router
sends a request to the prefill instance with `max_tokens: 1` and
`kv_transfer_params.do_remote_decode`; that instance runs the prompt, pins its blocks
and answers `kv_transfer_params` saying where they are (and the token it sampled);
the router copies that into the request it sends to the decode instance, which pulls
the blocks (tokenmill/kvcache/transfer), skips the prefill and generates the rest.
Without --kv-transfer-config the connector is disabled: it only refuses requests that
ask for a transfer.

Engine calls: `hold` (add_request: checks kv_transfer_params; a decode request is held
while its KV is pulled), `admit` (each step: pins served or expired are freed, pulled
requests installed and their first token returned), `on_finished` (the scheduler's
hook before it frees a finished sequence: a prefill request's blocks are pinned),
`abort`, `holders` (pins count as live block holders for check_integrity), `busy`,
`wait_for_pull` (an idle loop's pause, cut short when a pull lands).
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

from tokenmill.config import KVTransferConfig
from tokenmill.engine.core.append import Emitted
from tokenmill.engine.core.outputs import Logprob
from tokenmill.engine.core.validation import RequestError
from tokenmill.sequence import Sequence

logger = logging.getLogger(__name__)
PARAM = "kv_transfer_params"


class KVTransferConnector:
    def __init__(self, config: KVTransferConfig | None, block_manager: Any = None,
                 runner: Any = None, max_num_seqs: int = 0, vocab_size: int = 0) -> None:
        self.config = config
        self.producer = self.consumer = None
        self.server = None
        self._producing: dict[str, Any] = {}  # request id -> EngineRequest, until pinned
        self._pending: dict[str, Any] = {}  # request id -> consumer.Pending
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        if config is None:
            return
        import zmq

        from tokenmill.kvcache.transfer.consumer import KVConsumer
        from tokenmill.kvcache.transfer.producer import KVProducer
        from tokenmill.kvcache.transfer.transport import BlockServer
        from tokenmill.kvcache.transfer.wire import layout_of

        self.engine_id = config.engine_id or uuid.uuid4().hex
        block_dim = runner.backend.block_dim
        layout = layout_of(runner.kv_caches, block_manager.block_size, block_dim)
        self.block_size = block_manager.block_size
        self._ctx = zmq.Context()
        if config.is_producer:
            self.producer = KVProducer(block_manager, runner.kv_caches, block_dim, layout,
                                       config.pin_timeout_s)
            self.server = BlockServer(self._ctx, config.kv_ip, config.kv_port,
                                      self.producer.serve)
            logger.info("KV transfer: %s %s serving blocks on %s:%d", config.kv_role,
                        self.engine_id, config.kv_ip, self.server.port)
        if config.is_consumer:
            self.consumer = KVConsumer(self._ctx, block_manager, runner.kv_caches, block_dim,
                                       layout, runner.pool.fresh, config.pull_timeout_s)

    # ---- add / abort ---------------------------------------------------------------

    def hold(self, req: Any) -> bool:
        """Check the request's kv_transfer_params (RequestError naming the field); True:
        a decode request whose prompt KV is being pulled (not scheduled until then)."""
        params = req.params.kv_transfer_params
        if not params:
            return False
        if not isinstance(params, dict):
            raise RequestError("kv_transfer_params must be an object", PARAM)
        decode, prefill = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
        if not (decode or prefill):
            return False
        role = "producer (prefill)" if decode else "consumer (decode)"
        if self.config is None or (decode and self.producer is None) or \
                (prefill and self.consumer is None):
            raise RequestError(f"kv_transfer_params asks for a remote "
                               f"{'decode' if decode else 'prefill'}, but this server is no "
                               f"KV {role}: start it with --kv-transfer-config "
                               f"'{{\"kv_role\": \"kv_{role.split()[0]}\"}}'", PARAM)
        if decode and prefill:
            raise RequestError("kv_transfer_params: do_remote_decode and do_remote_prefill "
                               "cannot both be true", PARAM)
        if req.params.n != 1:
            raise RequestError("n must be 1 with kv_transfer_params (one sequence's KV is "
                               "transferred)", "n")
        if decode:
            if req.params.max_tokens != 1:
                raise RequestError("with kv_transfer_params.do_remote_decode the prefill "
                                   "instance generates exactly one token: max_tokens must "
                                   f"be 1, got {req.params.max_tokens}", "max_tokens")
            self._producing[req.request_id] = req
            return False
        if req.params.prompt_logprobs is not None or req.grammar is not None:
            raise RequestError("kv_transfer_params.do_remote_prefill does not support "
                               "prompt_logprobs or structured outputs", PARAM)
        remote = _remote(params)
        if not 0 <= remote.first_token_id < self.vocab_size:
            raise RequestError(f"kv_transfer_params.first_token_id {remote.first_token_id} is "
                               f"outside the vocabulary ({self.vocab_size} tokens)",
                               f"{PARAM}.first_token_id")
        if req.params.logprobs is not None and not remote.first_logprobs:
            raise RequestError("the request asks for logprobs but kv_transfer_params has no "
                               "first_logprobs (send the prefill instance the same logprobs)",
                               f"{PARAM}.first_logprobs")
        self._pending[req.request_id] = self.consumer.start(req.seqs[0], remote)
        return True

    def abort(self, request_id: str) -> None:
        """The request's pull result (if any) is dropped: nothing was allocated for it;
        a producer that has not sent the blocks yet is told to drop its pin now."""
        self._producing.pop(request_id, None)
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self.consumer.release(pending)

    # ---- each step -----------------------------------------------------------------

    def admit(self, scheduler: Any, stats: Any) -> Emitted:
        """Free the pins served or expired; install the pulled requests that fit (or
        fall back to prefilling the failed ones here); their first tokens."""
        if self.producer is not None:
            self.producer.release_finished()
        emitted: Emitted = []
        for rid, pending in list(self._pending.items()):
            if not pending.pulled.done():
                continue
            seq = pending.seq
            try:
                _, segments = self.consumer.check(pending)
            except Exception as e:  # noqa: BLE001 - TransferError, or the pull's own error
                logger.warning("request %s: KV transfer failed (%s); prefilling here", rid, e)
                del self._pending[rid]
                self.consumer.release(pending)  # a late pull's pin goes now, not at timeout
                stats.kv_transfer_fallbacks += 1
                scheduler.add(seq)
                continue
            if scheduler.num_running >= self.max_num_seqs or not self.consumer.can_install(seq):
                continue  # no room yet: retried next step, the segments kept
            del self._pending[rid]
            self.consumer.install(seq, segments)
            scheduler.running.append(seq)
            stats.kv_transfer_received_tokens += seq.num_prompt_tokens
            emitted.append((seq, [pending.remote.first_token_id],
                            [_logprobs(pending.remote.first_logprobs, seq)]))
        return emitted

    def on_finished(self, seq: Sequence) -> None:
        """A prefill request finished: pin its prompt blocks and say where they are."""
        req = self._producing.pop(seq.request_id, None)
        if req is None or seq.finish_reason == "abort" or not seq.output_token_ids \
                or seq.num_computed_tokens < seq.num_prompt_tokens:
            return
        blocks = seq.block_table[:-(-seq.num_prompt_tokens // self.block_size)]
        self.producer.pin(seq.request_id, blocks, seq.prompt_token_ids)
        first = seq.output_token_ids[0]
        lps = seq.output_logprobs[0] if seq.output_logprobs else None
        req.kv_transfer_params = {
            "do_remote_decode": False, "do_remote_prefill": True,
            "remote_engine_id": self.engine_id, "remote_block_ids": blocks,
            "remote_host": self.config.kv_ip, "remote_port": self.server.port,
            "remote_request_id": seq.request_id, "tp_size": 1,
            "first_token_id": first,
            "first_logprobs": None if lps is None else [
                [tid, lp.logprob, lp.rank] for tid, lp in lps.items()],
        }

    def pulls_in_flight(self) -> int:
        return sum(not p.pulled.done() for p in self._pending.values())

    def wait_for_pull(self, timeout_s: float) -> None:
        """Sleep up to timeout_s (an idle engine loop's pause between empty steps), or
        until a pull in flight lands, so that its request is installed at once."""
        futures = [p.pulled for p in self._pending.values() if not p.pulled.done()]
        if futures:
            wait(futures, timeout_s, FIRST_COMPLETED)
        else:
            time.sleep(timeout_s)

    def holders(self) -> list:
        return self.producer.holders() if self.producer is not None else []

    def busy(self) -> bool:
        """Pins wait to be freed: the engine loop must keep stepping."""
        return self.producer is not None and self.producer.busy

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.consumer is not None:
            self.consumer.close()
        if self.config is not None:
            self._ctx.term()
            self.config = None


def _remote(params: dict) -> Any:
    from tokenmill.kvcache.transfer.consumer import RemotePrefill

    def need(name: str, kind: type) -> Any:
        value = params.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise RequestError(f"kv_transfer_params.{name} must be a {kind.__name__} "
                               f"(from the prefill instance's reply), got {value!r}",
                               f"{PARAM}.{name}")
        return value

    block_ids = need("remote_block_ids", list)
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids):
        raise RequestError("kv_transfer_params.remote_block_ids must be block numbers",
                           f"{PARAM}.remote_block_ids")
    port = need("remote_port", int)
    if not 0 < port < 65536:
        raise RequestError(f"kv_transfer_params.remote_port must be a port, got {port}",
                           f"{PARAM}.remote_port")
    lps = params.get("first_logprobs")
    return RemotePrefill(need("remote_host", str), port, need("remote_request_id", str),
                         block_ids, need("first_token_id", int),
                         lps if isinstance(lps, list) else None)


def _logprobs(entries: list | None, seq: Sequence) -> dict | None:
    if seq.sampling_params.logprobs is None or not entries:
        return None
    return {int(t): Logprob(logprob=float(lp), rank=None if r is None else int(r))
            for t, lp, r in entries}
