"""What crosses the boundary between the front end and the engine core process.

Typed msgspec Structs, msgpack on the wire. Front end -> core: requests in
(token ids, never text: tokenization stays in the front end), aborts, a
shutdown. Core -> front end: one `CoreReady` at start-up, one `StepOutputs`
per engine step (new token ids only, so a long output costs O(1) per step,
and the stats of that step), `Heartbeat`s from a thread of their own, so
that a long step still beats and only a stopped or frozen process goes quiet,
and a `ServerInfo` when what /server_info says changes after start-up.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenmill.config import ModelConfig
from tokenmill.engine.core.outputs import Logprob
from tokenmill.engine.core.stats import EngineStats
from tokenmill.lora_request import LoRARequest
from tokenmill.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic(): one clock for all processes of a machine
    lora_request: LoRARequest | None = None  # a served adapter, by name; None: the base


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Abort whatever is in flight and exit 0."""


class LoadLoRA(msgspec.Struct, tag="lora_load"):
    """/v1/load_lora_adapter: serve the PEFT adapter at `lora_path` as `lora_name`."""

    call_id: int
    lora_name: str
    lora_path: str


class UnloadLoRA(msgspec.Struct, tag="lora_unload"):
    call_id: int
    lora_name: str


ToCore = AddRequest | AbortRequests | Shutdown | LoadLoRA | UnloadLoRA


class CoreReady(msgspec.Struct, tag="ready"):
    pid: int
    model_name: str
    model_config: ModelConfig
    max_model_len: int
    max_num_seqs: int
    eos_token_ids: list[int]
    stats: EngineStats
    server_info: dict  # GET /server_info, computed where the engine config is resolved
    lora_adapters: list[LoRARequest] | None = None  # served at start; None: LoRA is off


class Ack(msgspec.Struct, array_like=True):
    """The core took the request (error None) or refused it (a RequestError's words)."""

    request_id: str
    error: str | None = None
    param: str | None = None


class SeqDelta(msgspec.Struct, array_like=True):
    index: int  # which of the request's n samples
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None  # one per new token, when asked for
    finish_reason: str | None
    stop_reason: int | str | None


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    seqs: list[SeqDelta]
    finished: bool
    num_cached_tokens: int
    first_scheduled_time: float | None
    first_token_time: float | None
    # vLLM's shape (None for the first prompt token); sent once, on the first delta
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # a prefill for a remote decode, on its last delta: where its KV waits
    kv_transfer_params: dict[str, Any] | None = None


class StepOutputs(msgspec.Struct, tag="outputs"):
    acks: list[Ack]
    outputs: list[RequestDelta]
    stats: EngineStats | None  # None: unchanged, or about to change in the next step
    # the step raised: these requests were aborted in the core, others carry on
    failed_request_ids: list[str] = []
    error: str | None = None


class Heartbeat(msgspec.Struct, tag="beat"):
    num_steps: int
    step_running_s: float | None  # how long the current step has run; None between steps


class ServerInfo(msgspec.Struct, tag="server_info"):
    """GET /server_info anew: the background oneDNN compile started or finished."""

    server_info: dict


class LoRAUpdated(msgspec.Struct, tag="lora_updated"):
    """The answer to a LoadLoRA / UnloadLoRA: the adapters served now, or why not."""

    call_id: int
    served: list[LoRARequest]
    error: str | None = None
    param: str | None = None
    not_found: bool = False  # the error is an unknown adapter (a 404)


FromCore = CoreReady | StepOutputs | Heartbeat | ServerInfo | LoRAUpdated

encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
