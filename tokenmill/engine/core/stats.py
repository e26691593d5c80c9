"""EngineStats: the engine's counters, one snapshot object (the server's metrics,
`tokenmill bench`'s server side and the core process's replies read it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.core.iteration_tokens import IterationTokens
from tokenmill.engine.core.phase_timer import STEP_PHASES


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
    # the most LoRA adapters one step ran, and the most in a step that also ran the base
    max_loras_in_step: int = 0
    max_loras_in_step_with_base: int = 0
    # vLLM's lora_requests_info: --max-loras (0: LoRA off), adapter names, comma-joined
    max_lora: int = 0
    running_lora_adapters: str = ""
    waiting_lora_adapters: str = ""
    num_prefill_tokens: int = 0  # tokens run through the model as prefill (incl. recompute)
    num_decode_tokens: int = 0
    # MoE: routed-expert weight bytes read (rank 0, CPU path; models/moe.py)
    moe_expert_bytes: int = 0
    # --async-scheduling: steps during which the next one was scheduled (the rest
    # ran synchronously: see engine/core/overlap.py for when)
    num_async_steps: int = 0
    # prefill/decode disaggregation, decode side: prompt tokens whose KV was pulled, and
    # requests prefilled here because the pull failed or timed out
    kv_transfer_received_tokens: int = 0
    kv_transfer_fallbacks: int = 0
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

    def count_step(self, batch) -> None:
        """A scheduled step's prefill and decode tokens, counted before it runs
        (the sequences' computed counts are not advanced yet)."""
        self.num_steps += 1
        self.iteration_tokens.observe(sum(item.num_new_tokens for item in batch.scheduled))
        ids = {item.seq.lora_int_id for item in batch.scheduled}
        adapters = len(ids - {0})
        self.max_loras_in_step = max(self.max_loras_in_step, adapters)
        if 0 in ids:
            self.max_loras_in_step_with_base = max(self.max_loras_in_step_with_base, adapters)
        for item in batch.scheduled:
            seq = item.seq
            if item.num_new_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self.num_decode_tokens += 1
            else:
                self.num_prefill_tokens += item.num_new_tokens

    def refresh(self, scheduler: Any, block_manager: Any, speculator: Any,
                runner: Any = None) -> EngineStats:
        """The gauges read afresh from the scheduler, the block manager and the
        speculator (the counters are kept as the steps run)."""
        bm = block_manager
        self.num_running = scheduler.num_running
        self.num_waiting = scheduler.num_waiting
        self.num_free_blocks = bm.num_free_blocks
        self.num_total_blocks = bm.num_total_blocks
        self.kv_cache_committed_bytes = (self.kv_cache_bytes * bm.num_touched_blocks
                                         // max(bm.num_total_blocks, 1))
        self.kv_cache_usage = bm.usage
        self.prefix_cache_queries = bm.prefix_cache_queries
        self.prefix_cache_hits = bm.prefix_cache_hits
        self.num_preemptions = scheduler.num_preemptions
        model = getattr(runner, "model", None)
        if getattr(model, "is_moe", False):
            from tokenmill.models.moe import expert_bytes_read

            self.moe_expert_bytes = expert_bytes_read(model)
        self.max_lora = scheduler.config.max_loras
        if self.max_lora:
            self.running_lora_adapters = _adapter_names(scheduler.running)
            self.waiting_lora_adapters = _adapter_names(scheduler.waiting)
        if speculator is not None:
            spec = speculator.stats
            self.spec_proposed_tokens = spec.num_proposed_tokens
            self.spec_accepted_tokens = spec.num_accepted_tokens
            self.spec_verified_steps = spec.num_verified_steps
        return self


def _adapter_names(seqs: Any) -> str:
    return ",".join(sorted({s.lora_request.lora_name for s in seqs if s.lora_request}))
