"""What has been sent of each choice of one request: turns the engine's
cumulative outputs into stream deltas, and feeds the per-request metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator

from tokenmill.engine.core.outputs import CompletionOutput, RequestOutput
from tokenmill.engine.frontend.engine_client import EngineClient
from tokenmill.engine.frontend.request_stream import RequestStream
from tokenmill.server.metrics import ServerMetrics


class Progress:
    def __init__(self, n: int, metrics: ServerMetrics, object_name: str,
                 max_tokens: int | None = None) -> None:
        self.object = object_name  # of the stream's chunks
        self.max_tokens = max_tokens  # the request's, for request_params_max_tokens
        self.created = int(time.time())
        self.text_len = [0] * n
        self.num_tokens = [0] * n
        self.finish_sent = [False] * n
        self.chunk_sent = [False] * n
        self.last_output_time: float | None = None
        self.metrics = metrics

    def deltas(self, out: RequestOutput, with_tokens: bool, announce: bool = False
               ) -> Iterator[tuple[CompletionOutput, str, int, int, bool]]:
        """Each choice with something new to stream: (output, text delta, index of its
        first unsent token, length of text already sent, is this its first chunk).
        A choice is due when its text grew, it finished, it has new tokens and
        `with_tokens` (logprobs ride on tokens), or it has sent nothing and
        `announce` (chat's role chunk). Marks what it yields as sent."""
        for c in out.outputs:
            i = c.index
            if self.finish_sent[i]:
                continue
            delta = c.text[self.text_len[i]:]
            new_tokens = len(c.token_ids) > self.num_tokens[i]
            first = not self.chunk_sent[i]
            if not (delta or c.finish_reason or (with_tokens and new_tokens)
                    or (announce and first)):
                continue
            yield c, delta, self.num_tokens[i], self.text_len[i], first
            self.chunk_sent[i] = True
            self.text_len[i] = len(c.text)
            self.num_tokens[i] = len(c.token_ids)
            self.finish_sent[i] = c.finish_reason is not None

    def chunk(self, request_id: str, model_name: str, choice: dict) -> dict:
        return {"id": request_id, "object": self.object, "created": self.created,
                "model": model_name, "choices": [choice]}

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if self.last_output_time is not None:
            self.metrics.observe_gap(now - self.last_output_time)
        self.last_output_time = now
        if out.finished:
            self.metrics.observe_finished(out, self.max_tokens)

    def end(self, stream: RequestStream, engine: EngineClient) -> None:
        """The consumer is done; a request that did not finish is aborted and counted."""
        if not stream.finished:  # the client left: free its KV blocks now
            engine.abort(stream.request_id)
        if not stream.finished or stream.aborted:
            self.metrics.observe_aborted()
