"""Input items -> the chat messages the template renders.

A run of `function_call` items joins the assistant message before it (one
assistant turn with its tool calls, as chat has it); a `function_call_output`
becomes a tool message and must answer a call made earlier in the
conversation. Echoed reasoning items are dropped, as chat templates drop
earlier turns' reasoning.
"""

from __future__ import annotations

from typing import Any

from tokenmill.server import protocol as p
from tokenmill.server.errors import APIError
from tokenmill.server.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    Item,
    MessageItem,
)


def to_messages(items: list[Item], history: list[p.ChatMessage],
                first_index: int = 0) -> list[p.ChatMessage]:
    """`history` (an earlier response's conversation) plus `items` as chat messages.
    `first_index`: the position of items[0] in the request's `input` (for errors)."""
    messages = list(history)
    call_ids = {c.id for m in history for c in m.tool_calls or []}
    for i, item in enumerate(items, first_index):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append(p.ChatMessage(role=role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = p.ToolCallParam(id=item.call_id, function=p.FunctionCall(
                name=item.name, arguments=item.arguments))
            call_ids.add(item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(p.ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in call_ids:
                raise APIError(400, f"input.{i}: no function call found for the "
                               f"function_call_output with call_id {item.call_id!r}",
                               param=f"input.{i}.call_id")
            messages.append(p.ChatMessage(role="tool", tool_call_id=item.call_id,
                                          content=item.text()))
    return messages


def output_messages(output: list[dict[str, Any]]) -> list[p.ChatMessage]:
    """A response's output items as the assistant turn a follow-up continues from."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    calls = [p.ToolCallParam(id=item["call_id"], function=p.FunctionCall(
        name=item["name"], arguments=item["arguments"]))
        for item in output if item["type"] == "function_call"]
    return [p.ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)]
