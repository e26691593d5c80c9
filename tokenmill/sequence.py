"""One sequence's state: token ids, how many have KV in the cache, its block
table and one status field. Plain Python, no torch."""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any

from tokenmill.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()

# async scheduling: a sampled token whose id is still on the device (never a real id)
PLACEHOLDER_TOKEN_ID = -1


class Sequence:
    """A prompt plus the tokens generated so far.

    `num_computed_tokens` counts tokens whose K/V are in the cache; the tokens
    still to feed the model are `token_ids[num_computed_tokens:]`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        index: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the stop token id or string
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.block_table: list[int] = []
        # chained prefix-cache hashes of block_table's leading full blocks that
        # are registered or were cache hits; owned by the block manager
        self.block_hashes: list[int] = []
        self.output_logprobs: list[dict] = []  # per output token: token id -> Logprob
        self.cumulative_logprob = 0.0
        self.output_text = ""
        self.detok_state: Any = None  # owned by the detokenizer
        self.sampler_state: Any = None  # owned by the sampler (e.g. a seeded generator)
        self.grammar: Any = None  # owned by tokenmill/structured: its grammar matcher
        self.lora_request: Any = None  # tokenmill.lora_request.LoRARequest; None: the base
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, {self.status.value}, "
                f"tokens={len(self)}, computed={self.num_computed_tokens})")

    @property
    def lora_int_id(self) -> int:
        """The adapter this sequence runs under; 0: the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finished_time = time.monotonic()
