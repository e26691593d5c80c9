"""The engine's counters (`EngineStats`) and the error of a request it cannot
take: plain Python, so the front end beside an engine core process reads them
without importing torch (which the core, loading at the same time, needs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.iteration_tokens import IterationTokens
from tokenmill.engine.phase_timer import STEP_PHASES


class RequestError(ValueError):
    """A request the engine cannot take; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    # bytes of KV blocks ever used: what the lazily touched pool adds to RSS so far
    kv_cache_committed_bytes: int = 0
    kv_cache_bytes: int = 0  # the whole pool
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    generation_tokens: int = 0
    num_steps: int = 0
    num_prefill_tokens: int = 0  # tokens run through the model as prefill (incl. recompute)
    num_decode_tokens: int = 0
    # --async-scheduling: steps during which the next one was scheduled (the rest
    # ran synchronously: see engine/overlap.py for when)
    num_async_steps: int = 0
    spec_proposed_tokens: int = 0  # speculative decoding: draft tokens verified
    spec_accepted_tokens: int = 0
    spec_verified_steps: int = 0  # (sequence, step) pairs that verified drafts
    time_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PHASES, 0.0))
    # tokens run per step, as a cumulative histogram (vLLM's iteration_tokens_total)
    iteration_tokens: IterationTokens = field(default_factory=IterationTokens)

    @property
    def mean_decode_batch(self) -> float:
        return self.num_decode_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return (self.spec_accepted_tokens / self.spec_proposed_tokens
                if self.spec_proposed_tokens else 0.0)

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per speculating step (accepted drafts + 1)."""
        return (1.0 + self.spec_accepted_tokens / self.spec_verified_steps
                if self.spec_verified_steps else 0.0)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["time_s"] = dict(self.time_s)
        d["iteration_tokens"] = self.iteration_tokens.as_dict()
        d["mean_decode_batch"] = self.mean_decode_batch
        d["spec_acceptance_rate"] = self.spec_acceptance_rate
        d["spec_mean_accepted_length"] = self.spec_mean_accepted_length
        return d
