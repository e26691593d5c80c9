"""Tokenization, chat-template rendering and long detokenization in worker
threads, off both the event loop and the engine loop.

A 7 MB prompt takes seconds to tokenize; on the event loop it stalls every
stream, on the engine loop every step. HF fast tokenizers are not safe to
share between threads (the Rust side raises "Already borrowed" when two calls
overlap), so each worker owns a copy, made when the pool starts (a deep copy
holds the GIL ~0.2 s: inside the first requests it delayed them and took CPU
from the engine). The Rust encoder releases the GIL, so a long encode in a
worker leaves the other threads running.

A tokenizer that says it is `thread_safe` (loaders/fast_tokenizer.py: the Rust
tokenizer alone, never reconfigured between calls, so every call borrows it
shared) is used by every worker as it is: no copies, and nothing held on the GIL
between the engine core's "ready" and the first /health 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# decoding up to this many tokens inline is cheaper than a hop to a worker
INLINE_DECODE_TOKENS = 256


class TokenizerPool:
    def __init__(self, tokenizer: Any, num_workers: int = 2) -> None:
        self.tokenizer = tokenizer  # the event loop's own, for short inline work
        self._local = threading.local()
        workers = max(1, num_workers)
        self._executor = ThreadPoolExecutor(max_workers=workers,
                                            thread_name_prefix="tokenmill-tokenizer")
        # every worker makes its copy now, in the background: one task each (a task
        # holds its worker at the barrier until each worker has one)
        barrier = threading.Barrier(workers)

        def warm() -> None:
            self._own()
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(timeout=30)

        # set before any worker runs _own(), which reads it
        self._shared = shared = getattr(tokenizer, "thread_safe", False)
        self._warming = [] if shared else [self._executor.submit(warm) for _ in range(workers)]

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until every worker holds its own copy of the tokenizer."""
        for f in self._warming:
            f.result(timeout)

    def _own(self) -> Any:
        if self._shared:
            return self.tokenizer
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tok

    async def _run(self, fn: Callable[[Any], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(self._own()))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(
            lambda tok: list(tok.encode(text, add_special_tokens=add_special_tokens)))

    async def render_chat(self, conversation: list[dict], **template_kwargs: Any
                          ) -> list[int]:
        """The conversation through the chat template, tokenized; the template
        holds the special tokens already. Template errors propagate."""
        def render(tok: Any) -> list[int]:
            text = tok.apply_chat_template(conversation, tokenize=False, **template_kwargs)
            return list(tok.encode(text, add_special_tokens=False))

        return await self._run(render)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        if len(token_ids) <= INLINE_DECODE_TOKENS:
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return await self._run(
            lambda tok: tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@functools.lru_cache(maxsize=4)
def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes one vocabulary entry spells (special tokens included).
    A byte-level BPE entry shows each byte as one character, so its string is
    never shorter in UTF-8 than the bytes it stands for. Cached per tokenizer: the
    server's front end computes it while the engine core loads (~0.5 s of CPU for a
    49k vocabulary), not after."""
    vocab = tokenizer.get_vocab()
    return max((len(tok.encode("utf-8")) for tok in vocab), default=1)
