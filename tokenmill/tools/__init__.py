"""Tool calling: parsers for the formats models write their calls in.

`get_parser(name)` for `--tool-call-parser NAME`; `ToolCallStream` turns a
streamed output into OpenAI tool-call deltas.
"""

from tokenmill.tools.base import ParsedOutput, ToolCall, ToolCallStream, ToolParser
from tokenmill.tools.formats import (
    HermesParser,
    JsonArrayParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    PythonicParser,
)

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of "
                         f"{', '.join(sorted(PARSERS))}") from None


__all__ = ["PARSERS", "JsonArrayParser", "NamedParser", "ParsedOutput", "ToolCall",
           "ToolCallStream", "ToolParser", "get_parser"]
