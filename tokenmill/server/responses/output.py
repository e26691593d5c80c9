"""A response's output items, built from the growing output text, and the
stream events that announce them.

The same builder serves a streamed response (fed after every engine output)
and a whole one (fed once, at the end): both end with the same items, so a
client that assembles the events gets the response it would have got whole.
Items: a `reasoning` item (with --reasoning-parser), a `message` with one
`output_text` part, then one `function_call` per tool call.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from tokenmill.server.reasoning import END, ReasoningParser, ReasoningStream
from tokenmill.server.tool_calls import ToolPlan
from tokenmill.tools import ToolCallStream

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self, tools: ToolPlan | None, reasoning: ReasoningParser | None) -> None:
        self.items: list[dict[str, Any]] = []
        self.calls = ToolCallStream(tools.parser) if tools and tools.parser else None
        self.parallel = tools.parallel if tools else True
        self.reasoning = ReasoningStream(reasoning) if reasoning else None
        self._open: dict[str, int] = {}  # "reasoning" | "message" -> index of the open item
        self._call_items: dict[int, int] = {}  # tool call index -> its item's index
        self._content_sent = 0
        self.status = "in_progress"

    def update(self, text: str, final: bool, status: str = "completed") -> list[Event]:
        """Events for the output text so far; `final` closes every item with `status`."""
        events: list[Event] = []
        content = text
        if self.reasoning is not None:
            reasoning_delta, _, split = self.reasoning.update(text, final)
            if reasoning_delta:
                events += self._reasoning_delta(reasoning_delta)
            if split.reasoning is not None and split.reasoning_done:
                events += self._close("reasoning", "completed" if END in text else status)
            content = split.content if split.reasoning_done else ""
        if self.calls is not None:
            content_delta, tool_deltas = self.calls.update(content, final)
        else:
            content_delta, tool_deltas = content[self._content_sent:], []
            self._content_sent = len(content)
        if content_delta:
            events += self._text_delta(content_delta)
        for delta in tool_deltas:
            if delta["index"] > 0 and not self.parallel:
                continue
            events += self._call_delta(delta)
        if final:
            if not self.items:  # an empty answer is still a message, as OpenAI's
                events += self._text_delta("")
            events += self._close("reasoning", status) + self._close("message", status)
            for index in self._call_items.values():
                events += self._close_call(index, status)
            self._call_items.clear()
            self.status = status
        return events

    # ---- items ----------------------------------------------------------------------

    def _add(self, kind: str, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        if kind:
            self._open[kind] = len(self.items) - 1
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]

    def _reasoning_delta(self, delta: str) -> list[Event]:
        events: list[Event] = []
        if "reasoning" not in self._open:
            events += self._add("reasoning", {
                "id": new_id("rs"), "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})
            events[-1]["item"]["content"] = []
        index = self._open["reasoning"]
        item = self.items[index]
        item["content"][0]["text"] += delta
        events.append({"type": "response.reasoning_text.delta", "item_id": item["id"],
                       "output_index": index, "content_index": 0, "delta": delta})
        return events

    def _text_delta(self, delta: str) -> list[Event]:
        events: list[Event] = []
        if "message" not in self._open:
            events += self._close("reasoning", "completed")
            events += self._add("message", {"id": new_id("msg"), "type": "message",
                                            "status": "in_progress", "role": "assistant",
                                            "content": []})
            index = self._open["message"]
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.items[index]["content"].append(part)
            events.append({"type": "response.content_part.added",
                           "item_id": self.items[index]["id"], "output_index": index,
                           "content_index": 0, "part": copy.deepcopy(part)})
        index = self._open["message"]
        item = self.items[index]
        item["content"][0]["text"] += delta
        if delta:
            events.append({"type": "response.output_text.delta", "item_id": item["id"],
                           "output_index": index, "content_index": 0, "delta": delta,
                           "logprobs": []})
        return events

    def _call_delta(self, delta: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        function = delta.get("function", {})
        if "id" in delta:  # a new call: what came before it is done
            events += self._close("reasoning", "completed") + self._close("message", "completed")
            events += self._add("", {"id": new_id("fc"), "type": "function_call",
                                     "status": "in_progress", "call_id": delta["id"],
                                     "name": function["name"], "arguments": ""})
            self._call_items[delta["index"]] = len(self.items) - 1
        index = self._call_items[delta["index"]]
        item = self.items[index]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append({"type": "response.function_call_arguments.delta",
                           "item_id": item["id"], "output_index": index,
                           "delta": function["arguments"]})
        return events

    def _close(self, kind: str, status: str) -> list[Event]:
        index = self._open.pop(kind, None)
        if index is None:
            return []
        item = self.items[index]
        item["status"] = status
        part = item["content"][0]
        events: list[Event]
        if kind == "reasoning":
            events = [{"type": "response.reasoning_text.done", "item_id": item["id"],
                       "output_index": index, "content_index": 0, "text": part["text"]}]
        else:
            events = [{"type": "response.output_text.done", "item_id": item["id"],
                       "output_index": index, "content_index": 0, "text": part["text"],
                       "logprobs": []},
                      {"type": "response.content_part.done", "item_id": item["id"],
                       "output_index": index, "content_index": 0,
                       "part": copy.deepcopy(part)}]
        return events + [{"type": "response.output_item.done", "output_index": index,
                          "item": copy.deepcopy(item)}]

    def _close_call(self, index: int, status: str) -> list[Event]:
        item = self.items[index]
        item["status"] = status
        return [{"type": "response.function_call_arguments.done", "item_id": item["id"],
                 "output_index": index, "name": item["name"], "arguments": item["arguments"]},
                {"type": "response.output_item.done", "output_index": index,
                 "item": copy.deepcopy(item)}]
