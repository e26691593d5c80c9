"""Per-request sampling parameters, named and defaulted as vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._check()

    def _check(self) -> None:
        def bad(param: str, msg: str) -> ValueError:
            err = ValueError(f"{param} {msg}")
            err.param = param  # type: ignore[attr-defined]
            return err

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
