"""A tokenizer loaded at its first use, for the engine core process.

The core of `tokenmill serve` uses its tokenizer only for a grammar's vocabulary, a
text prompt or `bad_words` (the front end tokenizes and detokenizes); loading it at
start-up put transformers' import (~0.7 s of CPU) and the tokenizer's load on the path
to the first /health 200 (issue 60). `warm()` loads it in a background thread once the
core has said it is ready, so the first request that needs it rarely waits.
"""

from __future__ import annotations

import threading
from typing import Any

from tokenmill.loaders.model_source import ModelSource
from tokenmill.loaders.tokenizer import load_tokenizer


class DeferredTokenizer:
    """Stands in for `load_tokenizer(source)`: attribute reads go to the real
    tokenizer, loaded once; `resolve()` returns it (for libraries that check types)."""

    def __init__(self, source: ModelSource) -> None:
        self._source = source
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def resolve(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self._source)
            return self._tokenizer

    def warm(self) -> None:
        threading.Thread(target=self.resolve, name="tokenmill-tokenizer", daemon=True).start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.resolve(), name)


def resolve_tokenizer(tokenizer: Any) -> Any:
    """The real tokenizer behind a DeferredTokenizer; any other tokenizer as it is."""
    return tokenizer.resolve() if isinstance(tokenizer, DeferredTokenizer) else tokenizer
