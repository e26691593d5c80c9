"""The tokenizer pool's workers copy the tokenizer when the pool starts, not in requests."""

from __future__ import annotations

import asyncio
import threading

from tokenmill.server.tokenizer_pool import TokenizerPool


class CountingTokenizer:
    """Stands in for an HF tokenizer: counts the copies and the threads that made them."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def __deepcopy__(self, memo: dict) -> CountingTokenizer:
        self.log.append(threading.current_thread().name)
        return CountingTokenizer(self.log)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]


def test_each_worker_copies_the_tokenizer_at_start_and_requests_make_none():
    copies: list[str] = []
    pool = TokenizerPool(CountingTokenizer(copies), num_workers=3)
    try:
        pool.wait_ready(timeout=30)
        assert len(copies) == 3 and len(set(copies)) == 3  # one per worker thread
        assert all(name.startswith("tokenmill-tokenizer") for name in copies)

        async def burst() -> list[list[int]]:
            return await asyncio.gather(*(pool.encode("a bb ccc " * i) for i in range(12)))

        results = asyncio.run(burst())
        assert results[2] == [1, 2, 3, 1, 2, 3]
        assert len(copies) == 3  # the 12 requests copied nothing
    finally:
        pool.shutdown()
