"""Pydantic models of a /v1/responses request and of its input items.

Items are checked one by one (`parse_items`), each against the model of its
`type`, so an error names the item and field (`input.2.call_id`) rather than
every branch of a union. What this server cannot do is refused by name:
built-in tools, `background`, non-text input parts, included extras.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from tokenmill.server.errors import APIError, validation_error
from tokenmill.server.protocol import MAX_MESSAGES, _Request

# OpenAI's hosted tools: this server runs none of them
BUILTIN_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26",
    "web_search_preview_2025_03_11", "file_search", "computer_use_preview", "computer_use",
    "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "apply_patch",
    "custom", "tool_search"})


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("type json_schema needs a schema")
        return self


class TextConfig(_Request):
    format: TextFormat | None = None


class ReasoningConfig(_Request):
    effort: None = None  # the thinking models served here take no effort setting
    summary: None = None
    generate_summary: None = None


class StreamOptions(_Request):
    include_obfuscation: bool = True  # nothing is obfuscated: there is no side channel


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=2**63 - 1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool) -> bool:
        if value:
            raise ValueError("background responses are not supported: send the request "
                             "without background (or stream it)")
        return value

    @field_validator("include")
    @classmethod
    def _nothing_included(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError(f"not supported: {', '.join(value)}")
        return value


# ---- input items -------------------------------------------------------------------


class ContentPart(_Request):
    type: Literal["input_text", "output_text", "refusal", "summary_text", "reasoning_text"]
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    def as_text(self) -> str:
        return self.text if self.text is not None else (self.refusal or "")


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.as_text() for part in self.content)


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.as_text() for part in self.output)


class ReasoningItem(_Request):
    """An earlier turn's reasoning, echoed back; chat templates drop it, as here."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ContentPart] = Field(default_factory=list)
    content: list[ContentPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEM_MODELS: dict[str, type[BaseModel]] = {
    "message": MessageItem, "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
_NON_TEXT_PARTS = ("input_image", "input_file", "input_audio")


def parse_items(raw: str | list[dict[str, Any]]) -> list[Item]:
    """The request's `input` as typed items; a 400 naming the first bad one."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    if not raw:
        raise APIError(400, "input: give at least one item", param="input")
    items: list[Item] = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message" if "role" in item else None)
        model = _ITEM_MODELS.get(kind) if isinstance(kind, str) else None
        if model is None:
            what = "has no type" if kind is None else f"has the unsupported type {kind!r}"
            raise APIError(400, f"input.{i} {what}; this server takes message, "
                           "function_call, function_call_output and reasoning items",
                           param=f"input.{i}.type")
        _refuse_non_text(item, i)
        try:
            items.append(model.model_validate(item))  # type: ignore[arg-type]
        except ValidationError as e:
            raise _at(e, f"input.{i}") from None
    return items


def _refuse_non_text(item: dict[str, Any], i: int) -> None:
    for field in ("content", "output"):
        parts = item.get(field)
        if not isinstance(parts, list):
            continue
        for j, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _NON_TEXT_PARTS:
                raise APIError(400, f"input.{i}.{field}.{j}: {kind} is not supported; this "
                               "server serves a text-only model", param=f"input.{i}.{field}.{j}.type")


def _at(error: ValidationError, prefix: str) -> APIError:
    """A pydantic error in a part of the request, named from the request's root."""
    errors = [{**e, "loc": ("body", *prefix.split("."), *e["loc"])} for e in error.errors()]
    return validation_error(errors)


# ---- tools ---------------------------------------------------------------------------


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def parse_tools(raw: list[dict[str, Any]] | None) -> list[FunctionTool]:
    tools = []
    for i, tool in enumerate(raw or []):
        kind = tool.get("type")
        if kind in BUILTIN_TOOLS:
            raise APIError(400, f"tools.{i}: the built-in tool {kind!r} is not supported; "
                           "this server runs function tools only", param=f"tools.{i}.type")
        if kind != "function":
            raise APIError(400, f"tools.{i}: unknown tool type {kind!r}; this server runs "
                           "function tools only", param=f"tools.{i}.type")
        try:
            tools.append(FunctionTool.model_validate(tool))
        except ValidationError as e:
            raise _at(e, f"tools.{i}") from None
    return tools


def named_tool_choice(choice: dict[str, Any]) -> str:
    """The function a {"type": "function", "name": ...} tool_choice names."""
    kind = choice.get("type")
    if kind in BUILTIN_TOOLS:
        raise APIError(400, f"tool_choice: the built-in tool {kind!r} is not supported",
                       param="tool_choice.type")
    if kind != "function":
        raise APIError(400, f"tool_choice: type {kind!r} is not supported; give none, auto, "
                       'required or {"type": "function", "name": ...}', param="tool_choice.type")
    name = choice.get("name")
    if not isinstance(name, str) or set(choice) - {"type", "name"}:
        raise APIError(400, 'tool_choice: a function choice is {"type": "function", '
                       '"name": NAME}', param="tool_choice.name")
    return name
