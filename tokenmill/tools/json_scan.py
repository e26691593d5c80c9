"""Where JSON values end in text that may still be growing (a stream).

A tool call streams its arguments as the raw text the model wrote, so the
fragments always add up to the final `arguments` string; these helpers find
that text in a partial output without a full JSON parser.
"""

from __future__ import annotations

import json
import re

_SCALAR = re.compile(r"-?[0-9][0-9.eE+\-]*|true|false|null")
_WS = " \t\r\n"


def skip_ws(text: str, i: int, also: str = "") -> int:
    while i < len(text) and (text[i] in _WS or text[i] in also):
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """text[i] is '"': the index after the closing quote, or None if unfinished."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at text[i], or None if unfinished."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = _SCALAR.match(text, i)
    if m is None or m.end() >= len(text):  # a number at the end may still grow
        return None
    return m.end()


def object_fields(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """text[i] is '{': its top-level keys -> (value start, value end or None),
    and the index after the object (None while unfinished)."""
    fields: dict[str, tuple[int, int | None]] = {}
    i += 1
    while True:
        i = skip_ws(text, i, ",")
        if i >= len(text):
            return fields, None
        if text[i] == "}":
            return fields, i + 1
        if text[i] != '"':
            return fields, None
        key_end = string_end(text, i)
        if key_end is None:
            return fields, None
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            return fields, None
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return fields, None
        end = value_end(text, i)
        fields[key] = (i, end)
        if end is None:
            return fields, None
        i = end
