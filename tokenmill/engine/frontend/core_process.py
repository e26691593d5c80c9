"""The engine core process: scheduler, KV cache and model runner, nothing else.

`python -m tokenmill.engine.frontend.core_process` is started by the front end
(`CoreClient`); it loads the model, says `CoreReady`, then loops on its main
thread: take what the front end sent, run one `LLMEngine.step()`, send the new
token ids of that step. The loop stays on the main thread because a libgomp
parallel region started from any other thread costs ~10x more (async_engine.py
has the numbers). Once ready it compiles the packed matmuls' oneDNN shapes on a
background thread (engine/runner/onednn_caches.py), off the start-up path, and
sends /server_info anew when that starts and when it ends.

A second thread sends a heartbeat every `--heartbeat-interval` seconds. It
needs no GIL for long (torch releases it inside ops), so a long prefill keeps
beating and only a stopped or frozen process goes quiet. The same thread exits
the process when the front end is gone: PR_SET_PDEATHSIG (Linux) kills the
core at once, the parent-pid poll catches the rest.

Under tensor parallelism a rank that dies breaks the group for good: the
core exits (the step's collective raises, or the heartbeat thread sees a
local worker gone between steps), and the front end's dead-core handling
answers 503 and ends the in-flight requests with an error.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import logging
import os
import signal
import sys
import threading
import time

import msgspec
import zmq

from tokenmill.attention.base import BackendUnavailable
from tokenmill.config import EngineConfig
from tokenmill.distributed.errors import TensorParallelError
from tokenmill.engine.core.builder import check_startup_choices
from tokenmill.engine.core.llm_engine import LLMEngine
from tokenmill.engine.core.lora_manager import UnknownLoRAError
from tokenmill.engine.core.outputs import RequestOutput
from tokenmill.engine.core.server_info import server_info
from tokenmill.engine.core.validation import RequestError
from tokenmill.engine.frontend import core_messages as m
from tokenmill.loaders.lora_adapter import LoRAAdapterError
from tokenmill.startup_timer import mark

logger = logging.getLogger("tokenmill.engine.core")

_PR_SET_PDEATHSIG = 1
# the exit code of a start-up choice that cannot run (argparse's): the front end
# exits with it too, the core's one-line message being the user's answer
USAGE_ERROR_EXIT = 2


class _DeltaTracker:
    """How many tokens of each sequence the front end has; outputs become deltas."""

    def __init__(self) -> None:
        self.sent: dict[str, dict[int, int]] = {}

    def delta(self, out: RequestOutput) -> m.RequestDelta:
        first = out.request_id not in self.sent
        sent = self.sent.setdefault(out.request_id, {})
        seqs = []
        for c in out.outputs:
            start = sent.get(c.index, 0)
            if start == len(c.token_ids) and c.finish_reason is None:
                continue
            sent[c.index] = len(c.token_ids)
            seqs.append(m.SeqDelta(c.index, c.token_ids[start:],
                                   c.logprobs[start:] if c.logprobs is not None else None,
                                   c.finish_reason, c.stop_reason))
        if out.finished:
            del self.sent[out.request_id]
        metrics = out.metrics
        return m.RequestDelta(out.request_id, seqs, out.finished, out.num_cached_tokens,
                              metrics.first_scheduled_time if metrics else None,
                              metrics.first_token_time if metrics else None,
                              out.prompt_logprobs if first else None,
                              out.kv_transfer_params if out.finished else None)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.sent.pop(rid, None)


class EngineCore:
    """The loop over one LLMEngine, between two ZMQ sockets."""

    def __init__(self, engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.tracker = _DeltaTracker()
        self.step_started_at: float | None = None  # read by the heartbeat thread
        self._sent_free_blocks = -1  # in the stats last sent to the front end
        self._sent_precompile_state = ""  # in the server_info last sent to the front end

    def ready(self) -> m.CoreReady:
        e = self.engine
        self._sent_precompile_state = e.precompile.state
        return m.CoreReady(pid=os.getpid(), model_name=e.model_name,
                           model_config=e.model_config, max_model_len=e.max_model_len,
                           max_num_seqs=e.config.max_num_seqs,
                           eos_token_ids=sorted(e.eos_token_ids), stats=e.get_stats(),
                           server_info=server_info(e),
                           lora_adapters=self._served_loras())

    def _served_loras(self) -> list | None:
        lora = self.engine.lora
        return None if lora is None else list(lora.served.values())

    def run(self) -> None:
        """Until a Shutdown arrives (the front end's exit is handled by the heartbeat)."""
        self.outbox.send(m.encoder.encode(self.ready()))
        mark("core: ready sent")
        self.engine.precompile.start()  # on this thread's intra-op thread count
        warm = getattr(self.engine.tokenizer, "warm", None)
        if warm is not None:  # a DeferredTokenizer: load it now, off the start-up path
            warm()
        while True:
            self._send_server_info_if_changed()
            busy = self.engine.has_unfinished_requests()
            acks, changed, stop = self._drain(timeout_ms=0 if busy else 500)
            if stop:
                self._abort_all()
                self.engine.close()  # the KV-event sockets, if any
                return
            busy = self.engine.has_unfinished_requests()
            if changed:  # before the step: the front end starts its response now.
                # Stats only when no step follows: a request just added counts as
                # waiting until the step schedules it, and the front end, which
                # counts it as in flight already, would count it twice.
                self._send(m.StepOutputs(acks, [], None if busy else self.engine.get_stats()))
            if busy:
                self._step()

    def _drain(self, timeout_ms: int) -> tuple[list[m.Ack], bool, bool]:
        """Everything the front end sent: (acks of the adds, anything changed, stop)."""
        acks: list[m.Ack] = []
        changed = False
        if not self.inbox.poll(timeout_ms):
            return acks, changed, False
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return acks, changed, False
            msg = m.to_core_decoder.decode(frame)
            changed = True
            if isinstance(msg, m.AddRequest):
                acks.append(self._add(msg))
            elif isinstance(msg, m.AbortRequests):
                self.engine.abort_request(msg.request_ids)
                self.tracker.forget(msg.request_ids)
            elif isinstance(msg, (m.LoadLoRA, m.UnloadLoRA)):
                self._send(self._update_lora(msg))
            else:
                return acks, changed, True

    def _add(self, msg: m.AddRequest) -> m.Ack:
        lora = msg.lora_request
        if lora is not None:
            # by name only: an adapter unloaded since the front end looked it up is
            # refused as unknown, never served again from its path behind the front end
            lora = dataclasses.replace(lora, lora_path="")
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params,
                                    arrival_time=msg.arrival_time, lora_request=lora)
        except RequestError as e:
            return m.Ack(msg.request_id, str(e), e.param)
        except Exception as e:
            logger.exception("engine rejected request %s", msg.request_id)
            return m.Ack(msg.request_id, f"the engine could not take the request "
                         f"({type(e).__name__})", "internal")
        return m.Ack(msg.request_id)

    def _update_lora(self, msg: m.LoadLoRA | m.UnloadLoRA) -> m.LoRAUpdated:
        """Load or unload an adapter between two steps, as the in-process routes do."""
        lora = self.engine.lora
        if lora is None:
            return m.LoRAUpdated(msg.call_id, [], "LoRA is off: start the server with "
                                 "--enable-lora", "lora_name")
        try:
            if isinstance(msg, m.LoadLoRA):
                lora.add(msg.lora_name, msg.lora_path)
            else:
                lora.remove(msg.lora_name)
        except UnknownLoRAError as e:
            return m.LoRAUpdated(msg.call_id, self._served_loras() or [], str(e),
                                 "lora_name", not_found=True)
        except LoRAAdapterError as e:
            return m.LoRAUpdated(msg.call_id, self._served_loras() or [], str(e), e.param)
        except Exception as e:
            logger.exception("LoRA adapter update %r failed", msg.lora_name)
            return m.LoRAUpdated(msg.call_id, self._served_loras() or [],
                                 f"LoRA adapter {msg.lora_name!r}: {type(e).__name__}: {e}",
                                 "lora_path")
        return m.LoRAUpdated(msg.call_id, self._served_loras() or [])

    def _step(self) -> None:
        steps_before = self.engine.stats.num_steps
        self.step_started_at = time.monotonic()
        try:
            outputs = self.engine.step()
        except TensorParallelError:
            raise  # the group is broken: no step can run again (main exits)
        except Exception as e:
            # The batch that failed is lost; fail its requests, keep serving.
            failed = list(self.engine.requests)
            logger.exception("engine step failed; failing %d in-flight requests", len(failed))
            self.engine.abort_request(failed)
            self.tracker.forget(failed)
            self._send(m.StepOutputs([], [], self.engine.get_stats(), failed,
                                     f"the engine failed while generating "
                                     f"({type(e).__name__}); the request was aborted"))
            return
        finally:
            self.step_started_at = None
        if self.engine.stats.num_steps == steps_before and not outputs:
            # nothing could be scheduled: do not spin (--async-scheduling's last
            # step runs no batch but brings the step before's outputs); a KV pull
            # that lands ends the pause
            self.engine.kv_transfer.wait_for_pull(0.005)
            stats = self.engine.get_stats()
            if stats.num_free_blocks != self._sent_free_blocks:  # a KV-transfer pin freed
                self._send(m.StepOutputs([], [], stats))
            return
        deltas = [self.tracker.delta(out) for out in outputs]  # none mid-prefill
        self._send(m.StepOutputs([], deltas, self.engine.get_stats()))

    def _send_server_info_if_changed(self) -> None:
        """/server_info anew when the background compile has started or finished."""
        state = self.engine.precompile.state
        if state != self._sent_precompile_state:
            self._sent_precompile_state = state
            self._send(m.ServerInfo(server_info(self.engine)))

    def _abort_all(self) -> None:
        self.engine.abort_request(list(self.engine.requests))

    def _send(self, msg: m.StepOutputs | m.ServerInfo | m.LoRAUpdated) -> None:
        if isinstance(msg, m.StepOutputs) and msg.stats is not None:
            self._sent_free_blocks = msg.stats.num_free_blocks
        self.outbox.send(m.encoder.encode(msg))


def _heartbeat(core: EngineCore, ctx: zmq.Context, address: str, interval_s: float,
               parent_pid: int) -> None:
    """Beat until the front end is gone; then end the whole process."""
    sock = ctx.socket(zmq.PUSH)  # sockets are not thread-safe: one of its own
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    while os.getppid() == parent_pid:
        broken = core.engine.parallel_failure()
        if broken is not None:
            logger.error("%s; the engine core exits", broken)
            os._exit(1)
        started = core.step_started_at
        beat = m.Heartbeat(core.engine.stats.num_steps,
                           None if started is None else time.monotonic() - started)
        try:
            sock.send(m.encoder.encode(beat), zmq.NOBLOCK)
        except zmq.Again:  # the front end is not reading: it will see silence
            pass
        time.sleep(interval_s)
    logger.error("the front end (pid %d) is gone; the engine core exits", parent_pid)
    os._exit(1)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent-pid poll does it
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="tokenmill engine core (started by the server)")
    ap.add_argument("--config-json", required=True, help="an EngineConfig as JSON")
    ap.add_argument("--inbox", required=True, help="ZMQ address the front end pushes to")
    ap.add_argument("--outbox", required=True, help="ZMQ address the front end pulls from")
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--heartbeat-interval", type=float, default=1.0)
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    _die_with_parent()
    if os.getppid() != args.parent_pid:
        return 1  # the front end died while we started
    # Ctrl-C and SIGTERM are the front end's to handle: it drains, then says Shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    config = msgspec.json.decode(args.config_json, type=EngineConfig)
    mark("core: interpreter, imports (torch)")
    try:  # checked here, not in the front end, which imports no torch (issue 60)
        check_startup_choices(config)
    except (BackendUnavailable, ValueError) as e:  # e.g. --attention-backend, TP size
        print(f"tokenmill serve: error: {e}", file=sys.stderr, flush=True)
        return USAGE_ERROR_EXIT
    engine = LLMEngine(config, detokenize=False, precompile_now=False)  # run() starts it
    mark("core: engine built")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(args.inbox)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(args.outbox)
    core = EngineCore(engine, inbox, outbox)
    threading.Thread(target=_heartbeat, name="tokenmill-heartbeat", daemon=True,
                     args=(core, ctx, args.outbox, args.heartbeat_interval,
                           args.parent_pid)).start()
    try:
        core.run()
    except TensorParallelError as e:
        logger.error("%s; the engine core exits", e)
        os._exit(1)
    logger.info("engine core stopped")
    os._exit(0)  # the heartbeat thread holds a socket: ctx.term() would wait on it


if __name__ == "__main__":
    sys.exit(main())
