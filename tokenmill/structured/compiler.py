"""Constraint -> xgrammar CompiledGrammar, off the engine loop, cached.

A compile takes from under a millisecond (a small schema) to seconds (a big
grammar); the engine loop serves every other request meanwhile, so compiles
run on one worker thread and the engine admits a constrained request only
once its future is done. Equal constraints (same `StructuredOutputsParams.key`)
share one future: a cached schema costs a dict lookup.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tokenmill.loaders.deferred_tokenizer import resolve_tokenizer
from tokenmill.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_MAX_CACHED = 512  # compiled grammars kept (LRU); a JSON schema's is a few hundred KB at most


class GrammarError(ValueError):
    """The constraint does not compile (bad schema, regex or grammar)."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(message)
        self.param = param


def choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of these strings" (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCache:
    """`submit(spec)` -> Future[CompiledGrammar]; `ready(spec)` once it is done."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()  # the server's event loop and the engine loop both submit
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built by the worker
        self.num_compiles = 0

    def submit(self, spec: StructuredOutputsParams) -> Future:
        key = spec.key
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")
            future = self._pool.submit(self._compile, spec)
            self._futures[key] = future
            while len(self._futures) > _MAX_CACHED:
                self._futures.popitem(last=False)
            return future

    def ready(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar if its compile is done (raises GrammarError if it failed)."""
        future = self.submit(spec)
        return future.result() if future.done() else None

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                resolve_tokenizer(self.tokenizer), vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        compiler = self._xgrammar_compiler()
        kind = spec.key[0]
        try:
            if spec.json is not None:
                # compact JSON only: no whitespace for a sampled model to spin on
                grammar = compiler.compile_json_schema(json.dumps(spec.json),
                                                       any_whitespace=False)
            elif spec.json_object:
                grammar = compiler.compile_json_schema('{"type": "object"}',
                                                       any_whitespace=False, strict_mode=False)
            elif spec.regex is not None:
                grammar = compiler.compile_regex(spec.regex)
            elif spec.choice is not None:
                grammar = compiler.compile_grammar(choice_grammar(spec.choice))
            else:
                grammar = compiler.compile_grammar(spec.grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, and more on odd input
            # xgrammar's messages start with "[hh:mm:ss] /project/cpp/file.cc:line: "
            reason = str(e).strip().split(": ", 1)[-1] if "/cpp/" in str(e) else str(e)
            reason = reason.encode("utf-8", "replace").decode()[:500]
            param = (f"structured_outputs.{kind}" if spec.param == "structured_outputs"
                     else spec.param)
            raise GrammarError(f"invalid {_NAMES[kind]}: {reason}", param) from None
        self.num_compiles += 1
        return grammar

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
          "choice": "choice", "grammar": "grammar"}
