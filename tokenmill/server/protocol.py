"""Pydantic models of the OpenAI API (completions, chat, models, errors) plus
vLLM's extras (top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids, /tokenize, /detokenize).

Bounds live in the field definitions so they show in /openapi.json;
`SamplingParams` checks them again for callers that bypass the server.

No request field is silently ignored: an unknown one is a 400 ("Unrecognized
request argument supplied: X", as OpenAI answers), except an explicit null
(it asks for nothing) and the metadata in `NO_OP_FIELDS`, which changes
nothing about the output. `allow_unknown_fields(True)` (`--allow-unknown-fields`)
drops unknown fields with a warning instead, as vLLM does.
"""

from __future__ import annotations

import logging
import time
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from tokenmill.sampling_params import SamplingParams

INT64_MAX = 2**63 - 1
MAX_N = 128  # as OpenAI
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs
# vLLM has no limits (nor flags) for these; each stop string is searched for in
# the text after every step, so their count and length are work per token
MAX_STOP_SEQUENCES = 64
MAX_STOP_CHARS = 1024  # per stop string
MAX_MESSAGES = 2048  # per chat request, as OpenAI

TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


logger = logging.getLogger(__name__)


class _Model(BaseModel):
    # JSON parsers accept NaN/Infinity; a NaN temperature must not reach the sampler
    model_config = ConfigDict(allow_inf_nan=False)


# Request metadata that changes nothing about the output (OpenAI's and clients'):
# accepted and dropped.
NO_OP_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key",
                          "safety_identifier", "prompt_cache_retention"})
_lenient = False


def allow_unknown_fields(allow: bool) -> None:
    """True: drop unknown request fields with a warning instead of a 400."""
    global _lenient
    _lenient = allow


def _accepts_none(annotation: Any) -> bool:
    return annotation is None or (typing.get_origin(annotation) in (typing.Union, types.UnionType)
                                  and type(None) in typing.get_args(annotation))


class _Request(_Model):
    """A request body or a part of one: unknown fields are errors (see the docstring)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_no_ops(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        known = set(fields) | {f.alias for f in fields.values() if f.alias}
        kept = {}
        for key, value in data.items():
            field = fields.get(key)
            if field is None and key not in known:
                if value is None or key in NO_OP_FIELDS:
                    continue  # null asks for nothing; metadata changes nothing
                if _lenient:
                    logger.warning("ignoring the unrecognized request field %r", key)
                    continue
            elif value is None and field is not None and not _accepts_none(field.annotation):
                continue  # an explicit null where null is not a value: the default
            kept[key] = value
        return kept


# ---- errors ----------------------------------------------------------------------


class ErrorInfo(_Model):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Model):
    error: ErrorInfo


# ---- requests --------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk too


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs`: one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    # a negative seed is refused (as OpenAI): the generator takes 0 .. 2**63 - 1
    seed: int | None = Field(None, ge=0, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # SGLang's names, which vllm-router adds to every request it forwards (at these
    # defaults): no_stop_trim is include_stop_str_in_output; hidden states are not served
    no_stop_trim: bool = False
    return_hidden_states: Literal[False] = False
    # token constraints and structured outputs (server/constraints.py, tokenmill/structured)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names of the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's prefill/decode disaggregation, as vllm-router's PD mode sends it
    # (engine/core/kv_transfer.py checks it; docs/scale-out.md)
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters, "
                             f"got {longest}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.stream and (self.kv_transfer_params or {}).get("do_remote_decode"):
            raise ValueError("kv_transfer_params.do_remote_decode needs stream false: the "
                             "prefill's reply carries where its KV is")
        return self

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         defaults: Mapping[str, Any] | None) -> SamplingParams:
        """`defaults`: --generation-config's values for the fields the request left unset."""
        defaults = defaults or {}

        def pick(name: str, builtin: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, builtin)

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", -1),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            skip_special_tokens=self.skip_special_tokens,
            kv_transfer_params=self.kv_transfer_params,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options
                                           and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    # a string, token ids, or a batch of either: one choice per prompt x n
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False  # before max_tokens: its validator reads it
    # 0 with echo: score the prompt only (lm-eval's loglikelihood requests)
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM
    best_of: int | None = Field(None, ge=1)  # only 1 (what vllm bench sends); else a 400
    # guidellm sends it next to max_tokens; the same limit
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)

    @field_validator("max_tokens")
    @classmethod
    def _zero_tokens_need_echo(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("must be at least 1 (0 only with echo, to score the prompt)")
        return value

    @property
    def prompt_only(self) -> bool:
        return self.max_tokens == 0

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        if self.best_of not in (None, 1):
            err = ValueError("best_of > 1 is not supported")
            err.param = "best_of"  # type: ignore[attr-defined]
            raise err
        max_tokens = self.max_tokens
        if self.max_completion_tokens is not None and "max_tokens" not in self.model_fields_set:
            max_tokens = self.max_completion_tokens
        params = self._sampling_params(1 if self.prompt_only else max_tokens,
                                       self.logprobs, defaults)
        wanted = [k for k in (self.prompt_logprobs,
                              self.logprobs if self.echo else None) if k is not None]
        params.prompt_logprobs = max(wanted) if wanted else None
        return params


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallParam(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    refusal: str | None = None  # an echoed assistant message's; changes nothing

    def text(self) -> str:
        if isinstance(self.content, list):  # parts joined with newlines, as vLLM
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self, content_format: str) -> dict[str, Any]:
        """The message as the chat template sees it: content as one string, or
        ("openai") as a list of text parts, for templates that loop over parts."""
        content: Any = self.text()
        if content_format == "openai":
            content = [{"type": "text", "text": part.text} for part in self.content] \
                if isinstance(self.content, list) else [{"type": "text", "text": content}]
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message

class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatTemplateFields(_Request):
    """How the conversation is rendered, as vLLM's chat and /tokenize take it."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is left open
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables
    documents: list[dict[str, str]] | None = None  # for RAG templates
    chat_template: str | None = None  # refused: the server's template is fixed

    @model_validator(mode="after")
    def _one_ending(self) -> ChatTemplateFields:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be true; set add_generation_prompt to false")
        return self

    def check_messages(self, messages: list[ChatMessage]) -> None:
        if self.continue_final_message and messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the "
                             "assistant's")


class ChatCompletionRequest(_SamplingRequest, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)  # deprecated alias, still sent
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    # SGLang's reasoning switches (vllm-router adds them to every chat request): they act
    # only with --reasoning-parser, as in SGLang. separate_reasoning false: the reasoning
    # stays in content; include_reasoning false: it is dropped; stream_reasoning false:
    # it is streamed in one delta once the </think> is read
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        # None: the generation config's max_new_tokens, else up to the context limit,
        # as vLLM does for chat
        max_tokens = (self.max_completion_tokens or self.max_tokens
                      or (defaults or {}).get("max_tokens"))
        return self._sampling_params(max_tokens,
                                     (self.top_logprobs or 0) if self.logprobs else None,
                                     defaults)


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


# ---- responses -------------------------------------------------------------------


class PromptTokensDetails(_Model):
    cached_tokens: int = 0  # prompt tokens served by the prefix cache


class UsageInfo(_Model):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Model):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(_Model):  # vLLM's
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(_Model):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM: per prompt token, None for the first; keys are token ids
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(_Model):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Model):
    content: list[ChatTokenLogprob] | None = None


class ToolCallFunction(_Model):
    name: str
    arguments: str


class ToolCallOut(_Model):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(_Model):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser only
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(_Model):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Model):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(_Model):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser only
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's partial tool-call deltas


class ChatChunkChoice(_Model):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Model):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(_Model):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Model):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Model):
    prompt: str


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")


def with_kv_transfer_params(body: dict[str, Any], finals: list) -> dict[str, Any]:
    """A prefill instance's reply carries, top level as vLLM's, where its KV waits (the
    router copies it into the decode request); other replies are unchanged."""
    params = next((f.kv_transfer_params for f in finals
                   if getattr(f, "kv_transfer_params", None)), None)
    if params is not None:
        body["kv_transfer_params"] = params
    return body
