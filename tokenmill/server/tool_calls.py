"""Tool calling for chat: what the template sees, what constrains the output,
and how the output becomes `tool_calls`.

tool_choice:
  none      tools shown to a template that knows them; output is content
  auto      the model's own format, parsed by `--tool-call-parser`
            (needs --enable-auto-tool-choice, as vLLM)
  required  output constrained to a JSON array of calls to the given tools
  named     output constrained to that function's arguments
`required` and named work with any model, since the grammar enforces them.

A chat template that knows nothing of tools (the embedded SmolLM2's) gets
them described in a system message, as llama.cpp's "generic" format does,
earlier tool calls and results rendered into the text, and null content as "".
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server import protocol as p
from tokenmill.server.errors import APIError
from tokenmill.tools import JsonArrayParser, NamedParser, ToolParser, get_parser

_REQUIRED = ('Reply with only a JSON list of the calls to make, each '
             '{"name": <function name>, "parameters": <arguments object>}.')


@dataclass
class ToolPlan:
    choice: str  # none | auto | required | named
    parser: ToolParser | None
    constraint: StructuredOutputsParams | None
    tools: list[dict] = field(default_factory=list)  # OpenAI tool dicts, for the template
    instruction: str = ""  # how to call, for a template that does not know tools
    parallel: bool = True

    @property
    def finish_reason(self) -> str:
        """finish_reason of an output that made calls (OpenAI: "stop" for a named choice)."""
        return "stop" if self.choice == "named" else "tool_calls"


def plan_tools(req: p.ChatCompletionRequest, auto_parser: str | None) -> ToolPlan | None:
    tools = req.tools or []
    choice = req.tool_choice or ("auto" if tools else "none")
    if not tools:
        if choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    dicts = [t.model_dump(exclude_none=True) for t in tools]
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none", None, None, dicts)
    if choice == "auto":
        if auto_parser is None:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                           "--tool-call-parser to be set", param="tool_choice")
        parser = get_parser(auto_parser)
        return ToolPlan("auto", parser, None, dicts, _describe(tools, parser.instruction),
                        parallel)
    if choice == "required":
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"enum": [t.function.name]},
                                              "parameters": _parameters(t)},
             "required": ["name", "parameters"]} for t in tools]}}
        if not parallel:
            calls["maxItems"] = 1
        return ToolPlan("required", JsonArrayParser(), StructuredOutputsParams(json=calls),
                        dicts, _describe(tools, _REQUIRED), parallel)
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools",
                       param="tool_choice.function.name")
    return ToolPlan("named", NamedParser(name), StructuredOutputsParams(json=_parameters(tool)),
                    dicts, _describe([tool], f"Call {name}: reply with only its arguments "
                                                 "as a JSON object."), False)


def _parameters(tool: p.Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _describe(tools: list[p.Tool], how: str) -> str:
    specs = json.dumps([t.function.model_dump(exclude_none=True) for t in tools],
                       ensure_ascii=False)
    return f"You can call these functions:\n{specs}\n{how}"


def template_knows_tools(template: str | None) -> bool:
    return isinstance(template, str) and "tools" in template


def conversation(messages: list[p.ChatMessage], plan: ToolPlan | None, knows_tools: bool,
                 content_format: str = "string") -> list[dict[str, Any]]:
    """The messages as the chat template gets them."""
    if knows_tools:
        return [_native(m, content_format) for m in messages]
    names: dict[str, str] = {}  # tool_call_id -> function name, for the results
    out: list[dict[str, Any]] = []
    for m in messages:
        text = m.text()
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for c in m.tool_calls:
                names[c.id or ""] = c.function.name
                calls.append({"name": c.function.name,
                              "parameters": _arguments(c.function.arguments)})
            text = (text + "\n" if text else "") + json.dumps(calls, ensure_ascii=False)
            out.append({"role": "assistant", "content": _content(text, content_format)})
        elif m.role == "tool":
            name = names.get(m.tool_call_id or "", m.name or "the function")
            out.append({"role": "user",
                        "content": _content(f"Result of {name}: {text}", content_format)})
        else:
            out.append(m.for_template(content_format))
    if plan is not None and plan.instruction:
        if out and out[0]["role"] == "system" and isinstance(out[0]["content"], str):
            out[0]["content"] += "\n\n" + plan.instruction
        else:
            out.insert(0, {"role": "system",
                           "content": _content(plan.instruction, content_format)})
    return out


def _content(text: str, content_format: str) -> Any:
    return [{"type": "text", "text": text}] if content_format == "openai" else text


def _native(m: p.ChatMessage, content_format: str) -> dict[str, Any]:
    msg = m.for_template(content_format)
    if m.tool_calls:  # HF templates expect arguments as an object
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in m.tool_calls]
    if m.tool_call_id:
        msg["tool_call_id"] = m.tool_call_id
    return msg


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def with_tools(params: SamplingParams, tools: ToolPlan | None) -> SamplingParams:
    """`params` constrained as the plan asks, and keeping the special tokens its parser reads."""
    if tools is None:
        return params
    if tools.constraint is not None:
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice {tools.choice!r} constrains the output already; "
                           f"drop {params.structured_outputs.param}",
                           param=params.structured_outputs.param)
        params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
            tools.constraint, param="tools"))
    if tools.parser is not None and tools.parser.needs_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params
