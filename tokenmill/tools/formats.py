"""The tool-call formats, named as vLLM's `--tool-call-parser` choices.

  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> (repeated)
  llama3_json  {"name": ..., "parameters": {...}}; {...}  (the whole output)
  mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
               or (tokenizer v11+) [TOOL_CALLS]name[ARGS]{...}
  pythonic     [get_weather(city="Paris"), other(x=1)]  (the whole output)
and two the server uses to enforce tool_choice (not selectable by flag):
  json_array   [{"name": ..., "parameters": {...}}, ...]  ("required")
  named        the arguments object of one given function
"""

from __future__ import annotations

import ast
import json
import re

from tokenmill.tools.base import ParsedOutput, PartialCall, Scan, ToolCall, ToolParser, held_back
from tokenmill.tools.json_scan import object_fields, skip_ws, value_end

_ARG_KEYS = ("arguments", "parameters")


def _json_call(text: str, i: int) -> tuple[PartialCall, int | None]:
    """The call object at text[i] ('{'), and the index after it (None: unfinished)."""
    fields, end = object_fields(text, i)
    name = None
    if "name" in fields and fields["name"][1] is not None:
        start, stop = fields["name"]
        value = json.loads(text[start:stop])
        name = value if isinstance(value, str) else None
    arguments = ""
    for key in _ARG_KEYS:
        if key in fields:
            start, stop = fields[key]
            arguments = text[start:stop] if stop is not None else text[start:]
            break
    else:
        if end is not None:
            arguments = "{}"
    return PartialCall(name, arguments, end is not None), end


def _json_calls(text: str, i: int, separators: str, closer: str = "") -> list[PartialCall]:
    """Consecutive call objects from text[i], until `closer` or anything else."""
    calls = []
    while True:
        i = skip_ws(text, i, separators)
        if i >= len(text) or text[i] != "{":
            return calls
        call, end = _json_call(text, i)
        calls.append(call)
        if end is None:
            return calls
        i = end


class HermesParser(ToolParser):
    name = "hermes"
    needs_special_tokens = True
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    instruction = ('To call a function, reply with one <tool_call></tool_call> block per call, '
                   'each holding {"name": <function name>, "arguments": <arguments object>}, '
                   'for example:\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.OPEN)
        if start == -1:
            return Scan(text if final else held_back(text, self.OPEN))
        calls = []
        while start != -1:
            body = start + len(self.OPEN)
            i = skip_ws(text, body)
            if i >= len(text) or text[i] != "{":
                break
            call, _ = _json_call(text, i)
            calls.append(call)
            close = text.find(self.CLOSE, i)
            if close == -1:
                break
            start = text.find(self.OPEN, close)
        return Scan(text[:text.find(self.OPEN)], calls)


def _calls_start(text: str, tag: str, opener: str, final: bool) -> int | Scan:
    """Where a reply made only of calls begins: the index of `opener` after whitespace
    and an optional `tag`; else the Scan to return (plain text, or nothing yet while a
    streamed prefix could still become the tag)."""
    i = skip_ws(text, 0)
    if text.startswith(tag, i):
        i = skip_ws(text, i + len(tag))
    elif not final and tag.startswith(text[i:]):
        return Scan("")  # undecided: a tag, a call or text may follow
    if i >= len(text):
        return Scan(text if final else "")
    if text[i] != opener:
        return Scan(text)
    return i


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    instruction = ('To call functions, reply with only JSON, one object per call separated '
                   'by "; ", each {"name": <function name>, "parameters": <arguments object>}.')

    def scan(self, text: str, final: bool) -> Scan:
        start = _calls_start(text, self.TAG, "{", final)
        if isinstance(start, Scan):
            return start
        return Scan("", _json_calls(text, start, ";"))


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    instruction = ('To call functions, reply with [TOOL_CALLS] followed by a JSON list of '
                   'calls, each {"name": <function name>, "arguments": <arguments object>}.')

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.TAG)
        if start == -1:
            return Scan(text if final else held_back(text, self.TAG))
        content = text[:start]
        i = skip_ws(text, start + len(self.TAG))
        if i < len(text) and text[i] == "[":
            return Scan(content, _json_calls(text, i + 1, ","))
        calls = []  # v11: name[ARGS]{...}, repeated after [TOOL_CALLS]
        while start != -1:
            i = skip_ws(text, start + len(self.TAG))
            args = text.find(self.ARGS, i)
            if args == -1:
                break
            a = skip_ws(text, args + len(self.ARGS))
            end = value_end(text, a)
            calls.append(PartialCall(text[i:args].strip(),
                                     text[a:end] if end is not None else text[a:],
                                     end is not None))
            if end is None:
                break
            start = text.find(self.TAG, end)
        return Scan(content, calls)


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def _call_end(text: str, i: int) -> int | None:
    """text[i] is '(': the index after its matching ')', minding Python strings."""
    depth, j, quote = 0, i, ""
    while j < len(text):
        c = text[j]
        if quote:
            if c == "\\":
                j += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


class PythonicParser(ToolParser):
    name = "pythonic"
    TAG = "<|python_start|>"
    instruction = ('To call functions, reply with only a Python list of calls with keyword '
                   'arguments, for example: [get_weather(city="Paris"), get_time()]')

    def scan(self, text: str, final: bool) -> Scan:
        start = _calls_start(text, self.TAG, "[", final)
        if isinstance(start, Scan):
            return start
        calls = []
        i = start + 1
        while True:
            i = skip_ws(text, i, ",")
            m = _NAME.match(text, i)
            if m is None:
                break
            open_paren = skip_ws(text, m.end())
            if open_paren >= len(text) or text[open_paren] != "(":
                break
            end = _call_end(text, open_paren)
            if end is None:
                calls.append(PartialCall(m.group(), ""))
                break
            calls.append(PartialCall(m.group(), _kwargs_json(text[i:end]), True))
            i = end
        return Scan("", calls)


def _kwargs_json(call_text: str) -> str:
    try:
        node = ast.parse(call_text, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return ""
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        return json.dumps(kwargs, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError):
        return ""  # not a literal call: parse() then treats the output as text


class JsonArrayParser(ToolParser):
    """What `tool_choice="required"` constrains the output to."""

    name = "json_array"

    def scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return Scan(text if final else "")
        return Scan("", _json_calls(text, i + 1, ","))


class NamedParser(ToolParser):
    """A named `tool_choice`: the whole output is that function's arguments."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def scan(self, text: str, final: bool) -> Scan:
        return Scan("", [PartialCall(self.function_name, text, final)])

    def parse(self, text: str) -> ParsedOutput:
        """The whole output is the call, also when max_tokens cut its arguments short:
        as OpenAI and vLLM answer a named tool_choice (finish_reason "length"), and as
        the stream already sent it. The client then validates the arguments (instructor
        retries on them) instead of finding text where it asked for a call."""
        return ParsedOutput(None, [ToolCall(self.function_name, text)])
