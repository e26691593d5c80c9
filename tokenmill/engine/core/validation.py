"""Request admission: the one home of the checks a request must pass against the
loaded model before it may run — token ids inside the vocabulary, a prompt that is
not empty, a prompt + max_tokens inside the context, a request the KV cache can
ever hold, constraint token ids, bad_words as token ids, a grammar that compiles.

`LLMEngine.add_request` (the offline `LLM`, `tokenmill generate`, the engine core
process, the in-process server) runs `RequestValidator.admit`; the server runs the
same validator's `check_token_ids` on the fields it reads before the engine sees
them (stop_token_ids, prompt token ids, /tokenize's tokens). What is checked
elsewhere is of another kind: the body's shape (server/protocol.py, pydantic) and a
parameter's own range (SamplingParams.__post_init__), neither of which needs a model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tokenmill.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine cannot take; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Admitted:
    """A request that passed: its prompt as ids, and its parameters with
    max_tokens resolved and bad_words as token ids."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


class RequestValidator:
    """`cache_tokens`: how many tokens the whole KV cache holds (None: not checked,
    as in a front end that has no cache of its own)."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int,
                 context_note: str = "", cache_tokens: Callable[[], int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.context_note = context_note  # why max_model_len is what it is, if capped
        self.cache_tokens = cache_tokens

    def check_token_ids(self, ids: Iterable[int], param: str, what: str | None = None) -> None:
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise RequestError(f"{what or param} must be in [0, {vocab})", param)

    def admit(self, prompt: str | list[int], params: SamplingParams) -> Admitted:
        """Every check of the module doc but the grammar's (compiled by the caller's
        GrammarCache, off the loop); RequestError naming the field on the first failure."""
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            text, ids = None, [int(t) for t in prompt]
            self.check_token_ids(ids, "prompt", "prompt token ids")
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        max_tokens = self._check_context(len(ids), params.max_tokens)
        self._check_cache(len(ids), max_tokens, params.n)
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        return Admitted(text, ids, self.check_constraints(params))

    def _check_context(self, num_prompt: int, max_tokens: int | None) -> int:
        """max_tokens, resolved (None: what is left of the context)."""
        limit = f"this model's maximum context length is {self.max_model_len} tokens" \
                f"{self.context_note}; "
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt
            if max_tokens < 1:
                raise RequestError(f"{limit}the prompt has {num_prompt} tokens, leaving no "
                                   f"room to generate", "prompt")
        total = num_prompt + max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"{limit}you requested {total} tokens ({num_prompt} in the prompt, "
                f"{max_tokens} to generate). Reduce the prompt or max_tokens.", "max_tokens")
        return max_tokens

    def _check_cache(self, num_prompt: int, max_tokens: int, n: int) -> None:
        if self.cache_tokens is None:
            return
        cache_tokens = self.cache_tokens()
        # its n sequences share at most the prompt: a request that could never have
        # them all in the cache at once is refused rather than preempted forever
        needed = num_prompt + n * max_tokens if n > 1 else num_prompt + max_tokens
        if needed > cache_tokens:
            raise RequestError(
                f"the request needs {needed} tokens of KV cache (n={n}) but the whole "
                f"cache holds {cache_tokens}; raise --kv-cache-memory or reduce the request",
                "max_tokens")

    def check_constraints(self, params: SamplingParams) -> SamplingParams:
        """Token ids within the vocabulary; bad_words as token ids (as vLLM: the
        word and the word after a space)."""
        vocab = self.vocab_size
        for name, ids in (("logit_bias", list(params.logit_bias or {})),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            if any(t >= vocab for t in ids):
                raise RequestError(f"{name} token ids must be in [0, {vocab})", name)
        if not params.bad_words or params.bad_words_token_ids:
            return params
        words: set[tuple[int, ...]] = set()
        for word in params.bad_words:
            for variant in {word, " " + word.lstrip()}:
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids:
                    words.add(tuple(ids))
        return dataclasses.replace(params, bad_words_token_ids=[list(w) for w in sorted(words)])
