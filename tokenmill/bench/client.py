"""Async streaming client for OpenAI-compatible servers, timestamping every chunk.

Timestamps are `time.perf_counter()` seconds relative to the run's start, taken the
moment the network read that delivered a server-sent event returned (sse.py). A chunk is a *content* chunk when it carries
generated text (`choices[0].text` for completions, `delta.content` or
`delta.reasoning_content` for chat); a role-only first chunk, a finish chunk with empty
text and the usage chunk are not.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import msgspec

from tokenmill.bench.sse import DONE, BadChunk, sse_events

_encode = msgspec.json.Encoder().encode
_JSON = {"Content-Type": "application/json"}

# failure kinds that mean the server went away (the bench exits non-zero on them)
CONNECTION_FAILURES = ("connect", "disconnected", "timeout")
STALE_RETRIES = 4  # resends of a request whose kept-alive connection turned out closed


# a prompt: text, or (multi-turn) the chat messages so far
Prompt = str | list[dict[str, str]]


@dataclass
class RequestRecord:
    request_id: int
    prompt_len: int | None  # client tokenization of the prompt (chat: with the template)
    max_tokens: int
    planned_time_s: float = 0.0  # when the schedule said to send (slot free and arrived)
    send_time_s: float = 0.0
    end_time_s: float = 0.0  # last byte of the response, or the failure
    first_chunk_time_s: float | None = None  # any chunk, role-only included
    chunk_times_s: list[float] = field(default_factory=list)  # content chunks only
    chunk_tokens: list[int] = field(default_factory=list)  # tokens each content chunk carried
    chunk_texts: list[str] = field(default_factory=list)
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    client_output_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_kind: str | None = None  # connect | disconnected | timeout | http_NNN | ...
    prompt: Prompt | None = None  # as sent (not written to the JSON)
    server_timings: dict[str, Any] | None = None  # llama-server's `timings` object
    conversation_id: int | None = None  # multi-turn: the conversation, its turn
    turn_index: int = 0
    tokens_counted: int = 0  # running sum of chunk_tokens while streaming

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def text(self) -> str:
        return "".join(self.chunk_texts)

    def fail(self, kind: str, message: str, now_s: float) -> None:
        self.error_kind, self.error, self.end_time_s = kind, message, now_s




def render_as_text(messages: list[dict[str, str]]) -> str:
    """Chat messages as one completions prompt that only ever grows at the end: each
    reply is appended to the text it continues, each new user turn after a blank line,
    so turn k's prompt is a prefix of turn k+1's (as a chat template makes it)."""
    text = ""
    for m in messages:
        if m["role"] == "assistant":
            text += m["content"]
        else:
            text += ("\n\n" if text else "") + m["content"]
    return text


@dataclass
class ClientOptions:
    base_url: str
    model: str
    endpoint: str = "completions"  # completions | chat
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    # served LoRA adapter names: request i names lora_modules[i % n] as its `model`
    # (spread evenly; vLLM's `bench serve --lora-modules` picks one at random)
    lora_modules: list[str] = field(default_factory=list)


class OpenAIClient:
    """One httpx.AsyncClient for the whole run; the pool never limits concurrency."""

    # fields a strict server may reject; dropped (and reported) after a 400 that names them
    OPTIONAL_FIELDS = ("ignore_eos", "continuous_usage_stats")

    def __init__(self, options: ClientOptions) -> None:
        self.options = options
        self.headers = ({"Authorization": f"Bearer {options.api_key}"}
                        if options.api_key else {})
        self.http = httpx.AsyncClient(
            base_url=options.base_url.rstrip("/"), headers=self.headers,
            timeout=httpx.Timeout(options.timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        self.dropped_fields: list[str] = []
        self._session: aiohttp.ClientSession | None = None
        # resends after a dead kept-alive connection go out on a connection of their own:
        # the pool may hold more dead ones than there are retries (W2 against llama-server
        # -np 16 lost a request after 5 dead connections in a row)
        self._fresh_session: aiohttp.ClientSession | None = None
        self._stale_retries: dict[int, int] = {}  # id(record) -> resends on dead connections

    @property
    def session(self) -> aiohttp.ClientSession:
        """The streaming requests' session (aiohttp: its C HTTP parser costs a fraction of
        httpcore's pure-Python one per chunk, and a server-sent event is a chunk)."""
        if self._session is None:
            # idle connections kept 2 s, under the 5 s after which llama-server (and
            # uvicorn) close theirs: fewer dead ones to find in the pool
            self._session = self._new_session(aiohttp.TCPConnector(limit=0,
                                                                   keepalive_timeout=2.0))
        return self._session

    @property
    def fresh_session(self) -> aiohttp.ClientSession:
        """A session that opens a new connection for every request (a resend's)."""
        if self._fresh_session is None:
            self._fresh_session = self._new_session(aiohttp.TCPConnector(limit=0,
                                                                         force_close=True))
        return self._fresh_session

    def _new_session(self, connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            base_url=self.options.base_url.rstrip("/") + "/", headers=self.headers,
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=10.0,
                                          sock_read=self.options.timeout_s))

    async def warm(self) -> None:
        """Open a connection and pay lazy imports before the clock starts."""
        with contextlib.suppress(Exception):
            async with self.session.get("v1/models") as resp:
                await resp.read()

    async def aclose(self) -> None:
        await self.http.aclose()
        for session in (self._session, self._fresh_session):
            if session is not None:
                await session.close()

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.options.endpoint == "chat" else "/v1/completions"

    def payload(self, prompt: Prompt, max_tokens: int, request_id: int = 0) -> dict[str, Any]:
        o = self.options
        model = o.lora_modules[request_id % len(o.lora_modules)] if o.lora_modules \
            else o.model
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True,
                                "temperature": o.temperature,
                                "stream_options": {"include_usage": True}}
        if o.endpoint == "chat":
            body["messages"] = ([{"role": "user", "content": prompt}]
                                if isinstance(prompt, str) else prompt)
        else:
            body["prompt"] = prompt if isinstance(prompt, str) else render_as_text(prompt)
        if "continuous_usage_stats" not in self.dropped_fields:
            # vLLM-style per-chunk usage gives exact tokens per chunk where supported
            body["stream_options"]["continuous_usage_stats"] = True
        if o.ignore_eos and "ignore_eos" not in self.dropped_fields:
            body["ignore_eos"] = True
        body.update(o.extra_body)
        return body

    async def send(self, record: RequestRecord, prompt: Prompt, t0: float) -> RequestRecord:
        """Stream one request into `record`; never raises for a server-side failure."""
        for _ in range(len(self.OPTIONAL_FIELDS) + 1 + STALE_RETRIES):
            retry = await self._send_once(record, prompt, t0)
            if not retry:
                break
        return record

    async def _send_once(self, record: RequestRecord, prompt: Prompt, t0: float) -> bool:
        now = time.perf_counter
        chat = self.options.endpoint == "chat"
        body = self.payload(prompt, record.max_tokens, record.request_id)
        record.send_time_s = now() - t0
        done = False
        answered = False
        session = self.fresh_session if id(record) in self._stale_retries else self.session
        try:
            async with session.post(self.path.lstrip("/"), data=_encode(body),
                                    headers=_JSON) as resp:
                answered = True
                if resp.status != 200:
                    text = (await resp.read()).decode(errors="replace")
                    if resp.status in (400, 422) and self._drop_rejected_field(text, body):
                        return True
                    record.fail(f"http_{resp.status}", text[:500], now() - t0)
                    return False
                events = sse_events(resp.content.iter_any(), t0)
                try:
                    async for t, chunk in events:
                        if chunk is DONE:
                            done = True
                            break
                        if not isinstance(chunk, dict) or (
                                "error" in chunk and not chunk.get("choices")):
                            self._stream_error(record, chunk, t)
                            return False
                        self._on_chunk(record, chunk, t, chat)
                except BadChunk as e:
                    record.fail("bad_chunk", f"unparseable chunk: {e}", now() - t0)
                    return False
                finally:
                    await events.aclose()
                record.end_time_s = now() - t0
        except aiohttp.ClientConnectorError as e:
            record.fail("connect", f"cannot connect to {self.options.base_url}: {e}",
                        now() - t0)
            return False
        except TimeoutError as e:  # aiohttp's ServerTimeoutError is one
            record.fail("timeout", f"{type(e).__name__}: no chunk for "
                        f"{self.options.timeout_s:g} s {e}".rstrip(), now() - t0)
            return False
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
                aiohttp.ClientOSError) as e:
            if not answered and self._stale_retries.get(id(record), 0) < STALE_RETRIES:
                # a kept-alive connection the server had closed (llama-server closes its
                # idle ones): the request never reached it, so send it again (the pool
                # drops the dead connection) rather than count a failure the server did
                # not make
                self._stale_retries[id(record)] = self._stale_retries.get(id(record), 0) + 1
                return True
            record.fail("disconnected", f"server closed the connection mid-stream: "
                        f"{type(e).__name__}: {e}", now() - t0)
            return False
        except aiohttp.ClientError as e:
            record.fail("http_error", f"{type(e).__name__}: {e}", now() - t0)
            return False
        if not done and record.finish_reason is None:
            record.fail("incomplete", "stream ended without a finish_reason or [DONE]",
                        record.end_time_s)
        elif not record.chunk_times_s:
            record.fail("no_content", "the response carried no generated text",
                        record.end_time_s)
        return False

    @staticmethod
    def _stream_error(record: RequestRecord, chunk: Any, t: float) -> None:
        err = chunk.get("error") if isinstance(chunk, dict) else chunk
        msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        record.fail("stream_error", msg[:500], t)

    def _on_chunk(self, record: RequestRecord, chunk: dict, t: float, chat: bool) -> None:
        if record.first_chunk_time_s is None:
            record.first_chunk_time_s = t
        usage = chunk.get("usage")
        choices = chunk.get("choices") or []
        text = ""
        if choices:
            choice = choices[0]
            if chat:
                delta = choice.get("delta") or {}
                text = (delta.get("reasoning_content") or "") + (delta.get("content") or "")
            else:
                text = choice.get("text") or ""
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        if text:
            record.chunk_times_s.append(t)
            record.chunk_texts.append(text)
            if usage and usage.get("completion_tokens") is not None and choices:
                # continuous usage: the exact number of tokens this chunk carried (a
                # running total: summing the list each chunk was quadratic in the output)
                record.chunk_tokens.append(max(0, usage["completion_tokens"]
                                               - record.tokens_counted))
                record.tokens_counted += record.chunk_tokens[-1]
        if chunk.get("timings"):  # llama-server: its own prompt and decode times
            record.server_timings = chunk["timings"]
        if usage:
            record.usage_prompt_tokens = usage.get("prompt_tokens")
            record.usage_completion_tokens = usage.get("completion_tokens")

    def _drop_rejected_field(self, error_text: str, body: dict[str, Any]) -> bool:
        """Whether to resend without a field the server rejected. A request sent before
        another one's rejection dropped the field is resent too, not failed."""
        sent = {*body, *body.get("stream_options", {})}
        for name in self.OPTIONAL_FIELDS:
            if name in error_text and name in sent:
                if name not in self.dropped_fields:
                    self.dropped_fields.append(name)
                return True
        return False


async def fetch_model_name(base_url: str, api_key: str | None) -> str:
    """The first model the server lists at /v1/models; raises ConnectionError when the
    server cannot be reached."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with httpx.AsyncClient(timeout=10.0, headers=headers) as http:
            resp = await http.get(url)
    except httpx.HTTPError as e:
        raise ConnectionError(f"cannot reach {url}: {type(e).__name__}: {e}") from e
    if resp.status_code != 200:
        raise ConnectionError(f"GET {url} returned {resp.status_code}: {resp.text[:200]}")
    models = resp.json().get("data") or []
    if not models:
        raise ConnectionError(f"{url} lists no models; pass --model")
    return models[0]["id"]


def count_chunk_tokens(record: RequestRecord, tokenizer) -> None:
    """Fill in the client's own output token count and, when the server did not send
    per-chunk usage, the tokens each chunk carried: differences of the token count of
    the growing text (so they sum to the client's total). Without a tokenizer a chunk
    counts as one token."""
    if tokenizer is None:
        if len(record.chunk_tokens) != len(record.chunk_times_s):
            record.chunk_tokens = [1] * len(record.chunk_times_s)
        return
    total = len(tokenizer.encode(record.text, add_special_tokens=False))
    record.client_output_tokens = total
    if len(record.chunk_tokens) == len(record.chunk_times_s):
        return
    counts, text, seen = [], "", 0
    for piece in record.chunk_texts:
        text += piece
        n = len(tokenizer.encode(text, add_special_tokens=False))
        counts.append(max(0, n - seen))
        seen = max(seen, n)
    record.chunk_tokens = counts


def chat_prompt_len(tokenizer, prompt: Prompt) -> int | None:
    """Prompt tokens of a chat request as the server sees them: the model's chat
    template applied, with the generation prompt. None without a template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))
