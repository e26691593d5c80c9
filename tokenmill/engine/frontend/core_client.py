"""The front end's handle on an engine core in another process.

Same interface as `AsyncEngine` (add_request / abort / health / stats /
stop / shutdown), so the server does not know which layout it runs on.
`CoreClient` starts `python -m tokenmill.engine.frontend.core_process`, binds two ZMQ
sockets it connects to, and runs one reader thread that turns each step's
token ids into text (`OutputProcessor`) and watches the core:

- process exit (polled every 0.1 s) -> dead: every in-flight request ends
  with `EngineDiedError`, new ones get `EngineUnavailableError`, for good;
- nothing heard (no heartbeat, no output) for `hang_timeout_s` -> hung: the
  same, but it heals when the core speaks again (SIGSTOP, then SIGCONT);
- a step running past `stuck_after_s` while heartbeats still come -> `health`
  says so, nothing is aborted (a long prefill is slow, not dead).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.core.stats import EngineStats
from tokenmill.engine.core.validation import RequestError
from tokenmill.engine.frontend import core_messages as m
from tokenmill.engine.frontend.admission import Admission
from tokenmill.engine.frontend.output_processor import OutputProcessor, RequestState
from tokenmill.engine.frontend.remote_loras import RemoteLoRAs
from tokenmill.engine.frontend.request_stream import (
    DEFAULT_MAX_STREAM_BACKLOG,
    Aborted,
    Accepted,
    EngineDiedError,
    EngineStepError,
    EngineUnavailableError,
    RequestStream,
)
from tokenmill.loaders.deferred_tokenizer import DeferredTokenizer
from tokenmill.loaders.model_source import resolve_model
from tokenmill.loaders.tokenizer import load_front_end_tokenizer
from tokenmill.lora_request import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.startup_timer import mark
from tokenmill.structured.compiler import GrammarCache

logger = logging.getLogger(__name__)

_POLL_MS = 100
_DOWN_RETRY_AFTER_S = 5


class CoreStartError(RuntimeError):
    """The engine core process exited before it was ready."""


class CoreUsageError(CoreStartError):
    """The core refused a start-up choice (it printed why): a usage error, exit 2."""


_USAGE_ERROR_EXIT = 2  # core_process.USAGE_ERROR_EXIT (that module imports torch)


@dataclass
class FrontEndModel:
    """What the server reads of the model (`AsyncEngine.engine` in-process)."""

    model_name: str
    tokenizer: Any
    max_model_len: int
    model_config: ModelConfig
    server_info: dict  # what the core runs (GET /server_info)
    eos_token_ids: list[int]
    # compiles a request's constraint here too, so that one that cannot compile is a
    # 400 before it is sent (the core compiles its own copy). Its tokenizer is
    # transformers' (xgrammar reads one), loaded with xgrammar on the first constrained
    # request: neither is on the way to the first /health 200
    grammars: GrammarCache
    lora: RemoteLoRAs | None = None  # the served adapters (LoRAManager in-process)


class CoreClient(Admission):
    def __init__(self, config: EngineConfig, max_waiting: int | None = None,
                 hang_timeout_s: float = 10.0, stuck_after_s: float = 120.0,
                 log_level: str = "info",
                 max_stream_backlog: int = DEFAULT_MAX_STREAM_BACKLOG,
                 while_loading: Callable[[Any], None] | None = None) -> None:
        """`while_loading(tokenizer)`: the caller's own start-up work, run with the front
        end's tokenizer while the core loads (its exception kills the core and propagates)."""
        self.max_waiting = max_waiting
        self.max_stream_backlog = max_stream_backlog
        self.hang_timeout_s = hang_timeout_s
        self.stuck_after_s = stuck_after_s
        self._ipc_dir = tempfile.mkdtemp(prefix="tokenmill-core-")
        self._ctx = zmq.Context()
        self._to_core = self._bind(zmq.PUSH, "to-core")
        self._from_core = self._bind(zmq.PULL, "from-core")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.engine.frontend.core_process",
             "--config-json", msgspec.json.encode(config).decode(),
             "--inbox", self._address("to-core"), "--outbox", self._address("from-core"),
             "--parent-pid", str(os.getpid()),
             "--heartbeat-interval", str(min(1.0, hang_timeout_s / 4)),
             "--log-level", log_level],
            # not in our process group: Ctrl-C is the front end's to handle (drain first)
            start_new_session=True)
        mark("engine core spawned")
        try:
            source = resolve_model(config.model)
            tokenizer = load_front_end_tokenizer(source)  # while the core loads
            mark("front-end tokenizer loaded")
            if while_loading is not None:
                while_loading(tokenizer)
            ready = self._wait_ready()
            mark("engine core ready")
        except BaseException:
            self._kill_core()
            self._close_sockets()
            raise
        self.core_pid = ready.pid
        grammars = GrammarCache(DeferredTokenizer(source), ready.model_config.vocab_size,
                                ready.eos_token_ids)
        self.engine = FrontEndModel(ready.model_name, tokenizer, ready.max_model_len,
                                    ready.model_config, ready.server_info,
                                    ready.eos_token_ids, grammars)
        if ready.lora_adapters is not None:
            self.engine.lora = RemoteLoRAs(ready.lora_adapters, self._send)
        self.tokenizer = tokenizer
        self.max_num_seqs = ready.max_num_seqs
        self.stats: EngineStats = ready.stats  # replaced whole, never mutated
        self._processor = OutputProcessor(tokenizer, ready.eos_token_ids, ready.max_model_len)
        self._lock = threading.Lock()  # guards everything below and the send socket
        self._streams: dict[str, RequestStream] = {}
        self._states: dict[str, RequestState] = {}
        self._num_seqs_in_flight = 0
        self._accepting = True
        self._closed = False
        self._dead_reason: str | None = None
        self._hung_since: float | None = None
        self._last_heard = time.monotonic()
        self._step_running_s: float | None = None
        self._reader = threading.Thread(target=self._read, name="tokenmill-core-client",
                                        daemon=True)
        self._reader.start()

    # ---- event loop side ------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams, arrival_time: float | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Hand a request to the core; returns once the core has taken it.
        `lora_request`: a served adapter (the core runs it by name).

        Raises ValueError (validation, with `.param`), QueueFullError or
        EngineUnavailableError.
        """
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            text, ids = None, [int(t) for t in prompt]
        arrival = time.monotonic() if arrival_time is None else arrival_time
        stream = RequestStream(request_id, asyncio.get_running_loop(), params.n,
                               self.max_stream_backlog, self.abort)
        with self._lock:
            down = self._down_reason_locked()
            if down is not None:
                raise EngineUnavailableError(down, _DOWN_RETRY_AFTER_S)
            if not self._accepting:
                raise EngineUnavailableError("the server is shutting down")
            self._refuse_if_full_locked()
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already running")
            # registered before it is sent: the reader may see the answer at once
            self._streams[request_id] = stream
            self._states[request_id] = RequestState(request_id, text, ids, params, arrival)
            self._num_seqs_in_flight += stream.num_seqs
            if not self._send_locked(m.AddRequest(request_id, ids, params, arrival,
                                                  lora_request)):
                self._pop_locked(request_id)
                raise EngineUnavailableError("the engine core is not reachable",
                                             _DOWN_RETRY_AFTER_S)
        try:
            await stream.accepted()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); the core frees its KV blocks before its next step."""
        with self._lock:
            stream = self._pop_locked(request_id)
            if stream is None:
                return
            self._send_locked(m.AbortRequests([request_id]))
        stream.put(Aborted())

    def abort_in_flight(self) -> None:
        """End every request now with the "aborted" event (the shutdown timeout is up)."""
        with self._lock:
            self._accepting = False
            ids = list(self._streams)
            streams = [self._pop_locked(rid) for rid in ids]
            if ids and self._dead_reason is None and not self._closed:
                self._send_locked(m.AbortRequests(ids))
        for stream in streams:
            if stream is not None:
                stream.put(Aborted())

    def dead_reason(self) -> str | None:
        """Why the engine core process is gone; None while it lives (a hang is not death)."""
        with self._lock:
            return self._dead_reason

    def health(self) -> tuple[bool, str]:
        with self._lock:
            down = self._down_reason_locked()
            running = self._step_running_s
            accepting = self._accepting
        if down is not None:
            return False, down
        if running is not None and running > self.stuck_after_s:
            return False, f"the engine step has run for over {self.stuck_after_s:.0f} s"
        if not accepting:
            return False, "the server is shutting down"
        return True, "ok"

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def stop(self) -> None:
        """Ask the core to abort what is in flight and exit; does not wait."""
        with self._lock:
            self._accepting = False
            if self._dead_reason is None and not self._closed:
                self._send_locked(m.Shutdown())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core (killed after `timeout_s`), end every stream, close the sockets."""
        self.stop()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("the engine core did not stop in %.0f s; killing it", timeout_s)
            self._kill_core()
        self._reader.join(2.0)
        self._fail_all(Aborted())
        self._close_sockets()

    # ---- reader thread ---------------------------------------------------------------

    def _read(self) -> None:
        while not self._closed:
            try:
                if self._from_core.poll(_POLL_MS):
                    self._drain()
                self._watch()
            except Exception:  # the reader must not die: it is the front end's only ear
                logger.exception("core client reader failed; carrying on")

    def _drain(self) -> None:
        while True:
            try:
                frame = self._from_core.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = m.from_core_decoder.decode(frame)
            self._last_heard = time.monotonic()
            if isinstance(msg, m.Heartbeat):
                self._step_running_s = msg.step_running_s
            elif isinstance(msg, m.StepOutputs):
                self._step_running_s = None
                if msg.stats is not None:
                    self.stats = msg.stats
                self._on_outputs(msg)
            elif isinstance(msg, m.ServerInfo):
                self.engine.server_info = msg.server_info  # replaced whole, never mutated
            elif isinstance(msg, m.LoRAUpdated) and self.engine.lora is not None:
                self.engine.lora.answered(msg)

    def _on_outputs(self, msg: m.StepOutputs) -> None:
        for ack in msg.acks:
            if ack.error is None:
                stream = self._streams.get(ack.request_id)
                if stream is not None:
                    stream.put(Accepted())
                continue
            error: BaseException = (EngineStepError(ack.error) if ack.param == "internal"
                                    else RequestError(ack.error, ack.param))
            with self._lock:
                stream = self._pop_locked(ack.request_id)
            if stream is not None:
                stream.put(Accepted(error))
        for delta in msg.outputs:
            state = self._states.get(delta.request_id)
            if state is None:
                continue  # aborted meanwhile, or failed while the core was quiet
            out = self._processor.process(state, delta)
            if not out.finished:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    stream.put(out)
                continue
            with self._lock:
                stream = self._pop_locked(delta.request_id)
                if state.needs_core_abort:  # a stop string: the core would go on
                    self._send_locked(m.AbortRequests([delta.request_id]))
            if stream is not None:
                stream.put(out)
        if msg.failed_request_ids:
            error = EngineStepError(msg.error or "the engine failed")
            for request_id in msg.failed_request_ids:
                with self._lock:
                    stream = self._pop_locked(request_id)
                if stream is not None:
                    stream.put(error)

    def _watch(self) -> None:
        now = time.monotonic()
        if self._dead_reason is None and self.proc.poll() is not None:
            with self._lock:
                self._dead_reason = (f"the engine core process (pid {self.core_pid}) "
                                     f"{_describe_exit(self.proc.returncode)}")
            if not self._closed:
                logger.error("%s; in-flight requests fail, new ones get 503",
                             self._dead_reason)
                self._fail_all(EngineDiedError(self._dead_reason))
            return
        silent_s = now - self._last_heard
        if self._hung_since is None and silent_s > self.hang_timeout_s:
            self._hung_since = now
            reason = self._hang_reason(silent_s)
            logger.error("%s; failing in-flight requests", reason)
            ids = self._fail_all(EngineDiedError(reason))
            if ids:
                with self._lock:  # done once it runs again
                    self._send_locked(m.AbortRequests(ids))
        elif self._hung_since is not None and silent_s <= self.hang_timeout_s:
            logger.warning("the engine core answers again after %.1f s",
                           now - self._hung_since)
            self._hung_since = None

    # ---- helpers --------------------------------------------------------------------

    def _down_reason_locked(self) -> str | None:
        if self._dead_reason is not None:
            return self._dead_reason
        silent_s = time.monotonic() - self._last_heard
        if self._hung_since is not None or silent_s > self.hang_timeout_s:
            return self._hang_reason(silent_s)
        return None

    def _hang_reason(self, silent_s: float) -> str:
        return (f"the engine core (pid {self.core_pid}) has sent nothing for "
                f"{silent_s:.1f} s (hang timeout {self.hang_timeout_s:g} s)")

    def _pop_locked(self, request_id: str) -> RequestStream | None:
        stream = self._streams.pop(request_id, None)
        self._states.pop(request_id, None)
        if stream is not None:
            self._num_seqs_in_flight -= stream.num_seqs
        return stream

    def _fail_all(self, item: BaseException | Aborted) -> list[str]:
        with self._lock:
            ids = list(self._streams)
            streams = [self._pop_locked(rid) for rid in ids]
        for stream in streams:
            if stream is not None:
                stream.put(item)
        return ids

    def _send(self, msg: m.ToCore) -> bool:
        with self._lock:
            if self._dead_reason is not None or self._closed:
                return False
            return self._send_locked(msg)

    def _send_locked(self, msg: m.ToCore) -> bool:
        try:
            self._to_core.send(m.encoder.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:  # no core connected (dead), or the socket is closed
            return False

    def _address(self, name: str) -> str:
        return f"ipc://{self._ipc_dir}/{name}"

    def _bind(self, kind: int, name: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)  # never drop
        sock.bind(self._address(name))
        return sock

    def _wait_ready(self) -> m.CoreReady:
        while True:
            if self._from_core.poll(200):
                msg = m.from_core_decoder.decode(self._from_core.recv())
                if isinstance(msg, m.CoreReady):
                    return msg
            elif self.proc.poll() is not None:
                if self.proc.returncode == _USAGE_ERROR_EXIT:
                    raise CoreUsageError("the engine core refused a start-up choice")
                raise CoreStartError(f"the engine core {_describe_exit(self.proc.returncode)} "
                                     "before it was ready (its log is above)")

    def _kill_core(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _close_sockets(self) -> None:
        self._to_core.close(0)
        self._from_core.close(0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


def _describe_exit(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"
