"""A /v1/responses request checked and turned into what the chat path takes:
the conversation, the tool plan and the sampling parameters. Everything that
can be refused is refused here, before anything reaches the engine or the
store."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server import protocol as p
from tokenmill.server.constraints import check_compiles
from tokenmill.server.errors import APIError, validation_error
from tokenmill.server.responses.conversation import to_messages
from tokenmill.server.responses.protocol import (
    ResponsesRequest,
    named_tool_choice,
    parse_items,
    parse_tools,
)
from tokenmill.server.serving import Serving
from tokenmill.server.tool_calls import ToolPlan, plan_tools, with_tools


@dataclass
class Prepared:
    messages: list[p.ChatMessage]  # the conversation without the instructions
    input_items: list[dict[str, Any]]
    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolPlan | None
    text_format: dict[str, Any]
    tool_choice: Any
    tool_dicts: list[dict[str, Any]]


async def prepare(req: ResponsesRequest, serving: Serving) -> Prepared:
    serving.check_model(req.model)
    items = parse_items(req.input)
    tools = parse_tools(req.tools)
    history: list[p.ChatMessage] = []
    if req.previous_response_id is not None:
        previous = serving.responses.get(req.previous_response_id)
        if previous is None:
            raise APIError(400, f"Previous response with id {req.previous_response_id!r} not "
                           "found (never stored, deleted, or evicted from this server's "
                           "response store).", param="previous_response_id",
                           code="previous_response_not_found")
        history = previous.messages
    messages = to_messages(items, history)
    rendered = ([p.ChatMessage(role="system", content=req.instructions)]
                if req.instructions else []) + messages
    texts = [req.instructions or ""] + [m.text() for m in messages] + [
        c.function.arguments for m in messages for c in m.tool_calls or []]
    serving.check_prompt_bytes("".join(texts), "input")

    choice: Any = req.tool_choice
    if isinstance(choice, dict):
        choice = p.NamedToolChoice(function=p.NamedFunction(name=named_tool_choice(choice)))
    try:
        chat = p.ChatCompletionRequest(
            messages=rendered, tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls,
            tools=[p.Tool(function=p.FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters,
                strict=t.strict)) for t in tools] or None,
            max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
            top_p=req.top_p)
    except ValidationError as e:
        raise validation_error(list(e.errors())) from None
    plan = _renamed(lambda: plan_tools(chat, serving.config.tool_call_parser), "tool_choice")
    params = with_tools(serving.sampling_params(chat), plan)
    text_format = _text_format(req)
    constraint = _format_constraint(text_format)
    if constraint is not None:
        if params.structured_outputs is not None:
            raise APIError(400, f"text.format {text_format['type']} cannot be combined with "
                           f"tool_choice {plan.choice if plan else ''!r}, which constrains the "
                           "output already", param="text.format")
        await check_compiles(serving.grammars, constraint)
        params = dataclasses.replace(params, structured_outputs=constraint)
    try:
        prompt_ids = await serving.render_chat(rendered, chat, plan)
    except APIError as e:
        if e.param and e.param.startswith("messages"):
            e.param = "input"
        raise
    return Prepared(messages, [_dump_item(i) for i in items], prompt_ids, params, plan,
                    text_format, req.tool_choice or ("auto" if tools else "none"),
                    [t.model_dump(exclude_none=True) for t in tools])


def _renamed(call: Any, param: str) -> Any:
    try:
        return call()
    except APIError as e:
        if e.param and e.param.startswith("tool_choice"):
            e.param = param
        raise


def _text_format(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"type": "text"}
    return fmt.model_dump(by_alias=True, exclude_none=True)


def _format_constraint(fmt: dict[str, Any]) -> StructuredOutputsParams | None:
    if fmt["type"] == "json_object":
        return StructuredOutputsParams(json_object=True, param="text.format")
    if fmt["type"] == "json_schema":
        try:
            return StructuredOutputsParams(json=fmt["schema"], param="text.format.schema")
        except ValueError as e:
            raise APIError(400, f"text.format.schema: {e}", param="text.format.schema") from None
    return None


def _dump_item(item: Any) -> dict[str, Any]:
    return item.model_dump(exclude_none=True)
