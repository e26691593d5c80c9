"""The asyncio side of the engine, for the server.

One loop owns the `LLMEngine`: it alone calls add / abort / step / get_stats,
so the engine needs no locks. Requests from the event loop go into an inbox the
loop drains between steps; each request gets one asyncio queue that the loop
fills with `loop.call_soon_threadsafe`.

The owner calls `run` on the process's main thread and serves HTTP from
another (`tokenmill serve`): with torch's OpenMP (libgomp), a parallel region
started from any other thread costs ~40 us instead of ~4 us (measured: softmax
14 -> 59 us, bf16->fp32 copy 4 -> 40 us), which made every streamed token ~15
ms slower at batch 1 when the loop had a worker thread of its own.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tokenmill.distributed.errors import TensorParallelError
from tokenmill.engine.frontend.admission import Admission
from tokenmill.engine.frontend.request_stream import (  # noqa: F401 - the server imports them here
    DEFAULT_MAX_STREAM_BACKLOG,
    Aborted,
    Accepted,
    EngineDiedError,
    EngineStepError,
    EngineUnavailableError,
    QueueFullError,
    RequestStream,
    StreamBehindError,
)
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    stream: RequestStream
    lora_request: Any = None


@dataclass
class _Inbox:
    adds: deque[_Add] = field(default_factory=deque)
    aborts: set[str] = field(default_factory=set)
    abort_everything: bool = False


class AsyncEngine(Admission):
    """Runs `engine.step()` in a loop (`run`) while requests come and go.

    max_waiting: how many requests may wait for a running slot before new ones
    are refused (None: unbounded). stuck_after_s: a step running longer than
    this makes `health()` report the loop as stuck. max_stream_backlog: outputs
    a request's stream may hold unread before the request is aborted.
    """

    core_pid = None  # the engine runs in this process

    def __init__(self, engine: Any, max_waiting: int | None = None,
                 stuck_after_s: float = 120.0,
                 max_stream_backlog: int = DEFAULT_MAX_STREAM_BACKLOG) -> None:
        self.engine = engine
        self.max_stream_backlog = max_stream_backlog
        self.max_waiting = max_waiting
        self.stuck_after_s = stuck_after_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox = _Inbox()
        self._streams: dict[str, RequestStream] = {}  # engine loop only
        self.max_num_seqs = engine.config.max_num_seqs
        self._num_seqs_in_flight = 0  # sequences handed over and not finished (guarded)
        self._stopping = False
        self._accepting = True
        self._step_started_at: float | None = None
        self.last_step_end: float = time.monotonic()
        self.stats = _copy_stats(engine.get_stats())  # replaced whole, never mutated
        self._loop_thread: threading.Thread | None = None  # the thread running `run`
        self._finished = threading.Event()  # the loop has returned (or died)
        self._dead_reason: str | None = None

    # ---- event loop side --------------------------------------------------------

    def _loop_alive(self) -> bool:
        return not self._finished.is_set()

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams,
                          arrival_time: float | None = None, lora_request: Any = None
                          ) -> RequestStream:
        """Hand a request to the engine; returns once the engine has taken it.

        Raises ValueError (engine validation, with `.param`), QueueFullError or
        EngineUnavailableError.
        """
        stream = RequestStream(request_id, asyncio.get_running_loop(), params.n,
                               self.max_stream_backlog, self.abort)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        with self._lock:
            if not self._accepting or not self._loop_alive():
                raise EngineUnavailableError(self._dead_reason or "the server is shutting down")
            self._refuse_if_full_locked()
            self._inbox.adds.append(_Add(request_id, prompt, params, arrival, stream,
                                         lora_request))
            self._num_seqs_in_flight += stream.num_seqs
        self._wake.set()
        try:
            await stream.accepted()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); its KV blocks are freed before the next step."""
        with self._lock:
            self._inbox.aborts.add(request_id)
        self._wake.set()

    def abort_in_flight(self) -> None:
        """End every request now with the "aborted" event (the shutdown timeout is up)."""
        self.stop_accepting()
        with self._lock:
            self._inbox.abort_everything = True
        self._wake.set()

    def health(self) -> tuple[bool, str]:
        if not self._loop_alive():
            return False, self._dead_reason or "the engine loop is not running"
        started = self._step_started_at
        if started is not None and time.monotonic() - started > self.stuck_after_s:
            return False, f"the engine step has run for over {self.stuck_after_s:.0f} s"
        if self._stopping:
            return False, "the server is shutting down"
        return True, "ok"

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def stop(self) -> None:
        """Ask the loop to abort whatever is in flight and return; does not wait."""
        self.stop_accepting()
        self._stopping = True
        self._wake.set()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort whatever is still in flight and wait for the loop to return."""
        self.stop()
        loop_thread = self._loop_thread
        if loop_thread is not None and loop_thread is not threading.current_thread():
            self._finished.wait(timeout_s)

    # ---- engine loop side -----------------------------------------------------------

    def run(self) -> None:
        """The engine loop, on the calling thread, until `stop` / `shutdown`."""
        self._loop_thread = threading.current_thread()
        try:
            while not self._stopping:
                self._wake.clear()
                changed = self._drain_inbox()
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    if changed:
                        self._snapshot_stats()
                    self._wake.wait(0.5)
            self._abort_all(Aborted())
            self._snapshot_stats()
            close = getattr(self.engine, "close", None)  # LLMEngine: the KV-event sockets
            if close is not None:
                close()
        except BaseException as e:  # the loop must never die silently
            logger.exception("engine loop died")
            self._dead_reason = (str(e) if isinstance(e, TensorParallelError) else
                                 "the engine loop stopped after an internal error")
            self._abort_all(EngineUnavailableError(self._dead_reason))
            if not isinstance(e, Exception):
                raise
        finally:
            self._finished.set()

    def _drain_inbox(self) -> bool:
        with self._lock:
            adds, aborts = self._inbox.adds, self._inbox.aborts
            if self._inbox.abort_everything:
                aborts |= set(self._streams) | {add.request_id for add in adds}
            self._inbox = _Inbox()
        for add in adds:
            if add.request_id in aborts:
                self._release(add.stream, Aborted())
                continue
            try:
                self.engine.add_request(add.request_id, add.prompt, add.params,
                                        arrival_time=add.arrival_time,
                                        lora_request=add.lora_request)
            except ValueError as e:
                self._release(add.stream, Accepted(e))
                continue
            except Exception as e:
                logger.exception("engine rejected request %s", add.request_id)
                self._release(add.stream, Accepted(EngineStepError(
                    f"the engine could not take the request ({type(e).__name__})")))
                continue
            self._streams[add.request_id] = add.stream
            add.stream.put(Accepted())
        for request_id in aborts:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self.engine.abort_request(request_id)
                self._release(stream, Aborted())
        return bool(adds or aborts)

    def _step(self) -> None:
        steps_before = getattr(self.engine.stats, "num_steps", None)
        self._step_started_at = time.monotonic()
        try:
            outputs = self.engine.step()
        except TensorParallelError:
            raise  # a rank died: the group cannot run another step, the loop ends
        except Exception as e:
            # The batch that failed is lost; fail its requests, keep serving others.
            logger.exception("engine step failed; failing %d in-flight requests",
                             len(self._streams))
            self._abort_all(EngineStepError(
                f"the engine failed while generating ({type(e).__name__}); "
                "the request was aborted"))
            outputs = []
        finally:
            self._step_started_at = None
            self.last_step_end = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
                self._release(stream, out)
            else:
                stream.put(out)
        self._snapshot_stats()
        if not outputs and getattr(self.engine.stats, "num_steps", None) == steps_before:
            time.sleep(0.005)  # nothing could be scheduled: do not spin on the GIL

    def _abort_all(self, item: BaseException | Aborted) -> None:
        ids = list(self._streams)
        if ids:
            try:
                self.engine.abort_request(ids)
            except Exception:
                logger.exception("abort after failure failed")
        for request_id in ids:
            self._release(self._streams.pop(request_id), item)
        with self._lock:
            pending = list(self._inbox.adds)
            self._inbox.adds.clear()
        for add in pending:
            self._release(add.stream,
                          Accepted(EngineUnavailableError("the server is shutting down")))

    def _snapshot_stats(self) -> None:
        stats = self.engine.get_stats()
        snapshot = _copy_stats(stats)
        with self._lock:
            self.stats = snapshot

    def _release(self, stream: RequestStream, last_item: Any) -> None:
        """The request leaves the engine: free its place in the queue, then tell it."""
        with self._lock:
            self._num_seqs_in_flight -= stream.num_seqs
        stream.put(last_item)


def _copy_stats(stats: Any) -> Any:
    """A snapshot the event loop can read while the engine loop keeps counting."""
    return copy.deepcopy(stats)
