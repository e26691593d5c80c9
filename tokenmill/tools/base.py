"""Tool-call parsing: a model's output text -> content + tool calls.

Every parser implements `scan(text, final)` over the output so far and
returns what is safe to send: the content that can no longer turn out to be
the start of a tool call, and each call's name and raw argument text so far.
`parse` (whole responses) and `ToolCallStream` (streamed deltas) are built on
that one method, so streamed fragments reassemble to the non-streamed result.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass
class PartialCall:
    name: str | None  # None until the whole name has been written
    arguments: str  # raw argument JSON so far (a prefix of the final text)
    complete: bool = False


@dataclass
class Scan:
    content: str  # safe to send as message content
    calls: list[PartialCall] = field(default_factory=list)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


class ToolParser:
    name = ""
    # keep special tokens in the text: the format's markers are special tokens
    needs_special_tokens = False
    # how the format looks, for models whose chat template knows nothing of tools
    instruction = ""

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedOutput:
        scan = self.scan(text, final=True)
        if not scan.calls:
            return ParsedOutput(text, [])
        calls = []
        for call in scan.calls:
            if not call.complete or call.name is None or not _is_object(call.arguments):
                return ParsedOutput(text, [])  # not a well-formed call: it is text
            calls.append(ToolCall(call.name, call.arguments))
        content = scan.content if scan.content.strip() or not calls else None
        return ParsedOutput(content, calls)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def held_back(text: str, marker: str) -> str:
    """`text` minus a tail that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n]
    return text


class ToolCallStream:
    """Turns the growing output text of one choice into OpenAI stream deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content_sent = 0
        self.ids: list[str] = []
        self.args_sent: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def update(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content delta, tool_call deltas) for the text so far."""
        scan = self.parser.scan(text, final)
        if final:
            parsed = self.parser.parse(text)
            if parsed.tool_calls or not self.ids:
                scan = Scan(parsed.content or "", [PartialCall(c.name, c.arguments, True)
                                                   for c in parsed.tool_calls])
        content = ""
        if (scan.content.strip() or (final and not scan.calls)) \
                and len(scan.content) > self.content_sent:
            content = scan.content[self.content_sent:]
            self.content_sent = len(scan.content)
        # at most one delta per call in a chunk, as OpenAI: clients that merge deltas
        # by index across chunks (langchain, instructor's partials) lose a second one
        deltas: list[dict] = []
        for index, call in enumerate(scan.calls):
            delta: dict | None = None
            if index == len(self.ids):
                if call.name is None:
                    break
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self.args_sent.append(0)
                delta = {"index": index, "id": self.ids[index], "type": "function",
                         "function": {"name": call.name, "arguments": ""}}
            new = call.arguments[self.args_sent[index]:]
            if new:
                self.args_sent[index] = len(call.arguments)
                delta = delta or {"index": index, "function": {}}
                delta["function"]["arguments"] = new
            if delta is not None:
                deltas.append(delta)
        return content, deltas
