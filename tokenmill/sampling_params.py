"""Per-request sampling parameters, named and defaulted as vLLM's.

Constraints on the next token (a grammar, logit_bias, allowed_token_ids,
bad_words) are plain data here; tokenmill/structured/ turns them into one
batched mask/bias pass in the sampler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_LOGIT_BIAS = 100.0  # as OpenAI


def _bad(param: str, msg: str) -> ValueError:
    err = ValueError(f"{param} {msg}")
    err.param = param  # type: ignore[attr-defined]
    return err


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint on the whole output, named as vLLM's.

    json: a JSON schema (dict or JSON text); json_object: any JSON object;
    regex; choice: one of these strings; grammar: EBNF (xgrammar's dialect).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # the request field this came from, for error messages (not part of `key`)
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise _bad("structured_outputs.json", f"is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise _bad("structured_outputs.json", "must be a JSON schema object.")
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                         else [])
        if len(given) != 1:
            raise _bad("structured_outputs", "must set exactly one of json, regex, choice, "
                       f"grammar, json_object; got {given or 'none'}.")
        if self.choice is not None and (
                not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise _bad("structured_outputs.choice", "must be a non-empty list of "
                           "non-empty strings.")

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: equal keys share one compile."""
        if self.json is not None:
            return "json", json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: chosen token + top-k
    prompt_logprobs: int | None = None  # the same for each prompt token (vLLM)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] = field(default_factory=list)  # never generated
    # bad_words as token-id sequences, filled in by the engine's tokenizer
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # vLLM's: prefill/decode disaggregation (engine/core/kv_transfer.py), as the router sends it
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise _bad("logit_bias", "must map token ids to numbers.") from None
        self.bad_words = list(self.bad_words or [])
        self._check()
        self._check_constraints()

    @property
    def has_logit_constraints(self) -> bool:
        """Anything that changes the next-token distribution besides sampling."""
        return bool(self.structured_outputs is not None or self.logit_bias
                    or self.allowed_token_ids is not None or self.bad_words_token_ids
                    or self.bad_words)

    def _check_constraints(self) -> None:
        for token_id, bias in (self.logit_bias or {}).items():
            if token_id < 0:
                raise _bad("logit_bias", f"token ids must be non-negative, got {token_id}.")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise _bad("logit_bias", f"values must be in [-100, 100], got {bias}.")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise _bad("allowed_token_ids", "must not be empty.")
            if any(t < 0 for t in self.allowed_token_ids):
                raise _bad("allowed_token_ids", "must be non-negative token ids.")
        if any(not w for w in self.bad_words):
            raise _bad("bad_words", "must not contain empty strings.")
        if self.structured_outputs is not None:
            # the grammar decides when the output may end; these would fight it
            if self.min_tokens:
                raise _bad("min_tokens", "is not supported with structured outputs.")
            if self.ignore_eos:
                raise _bad("ignore_eos", "is not supported with structured outputs.")

    def _check(self) -> None:
        bad = _bad

        if self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", f"must be positive, got {self.repetition_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens={self.max_tokens}, "
                      f"got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", f"must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", f"must be non-negative, got {self.prompt_logprobs}.")
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings.")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
