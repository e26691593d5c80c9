"""Reasoning output (`--reasoning-parser`, vLLM's names): the `<think>…</think>`
span of a thinking model's output, split from the answer.

qwen3        Qwen3 writes `<think>` itself; output that does not start with it is
             all answer (`enable_thinking: false` puts an empty think block in
             the prompt). A <think> never closed: the whole output is reasoning.
deepseek_r1  R1 templates put `<think>` in the prompt, so the output starts inside
             the reasoning: everything before `</think>` is reasoning, and output
             that never closes it is reasoning only.

`split(text, final)` works on the whole output so far, so a streamed output's
deltas add up to the non-streamed split: the tail that may be the start of
`</think>` is held back until the next token (or the end) says what it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.tools.base import held_back

START, END = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str | None  # None: this output has no reasoning at all
    content: str
    reasoning_done: bool  # the </think> has been read (or the output ended)


class ReasoningParser:
    name = ""
    opened_by_prompt = False  # output before </think> is reasoning without a <think>

    def split(self, text: str, final: bool) -> Split:
        body = text.lstrip()
        if not final and body and START.startswith(body) and body != START:
            return Split(None, "", False)  # may still become <think>: wait
        if body.startswith(START):
            body = body[len(START):]
        elif self.opened_by_prompt:
            body = text
        else:
            return Split(None, text, True)
        end = body.find(END)
        if end < 0:
            return Split(body if final else held_back(body, END), "", final)
        return Split(body[:end], body[end + len(END):].lstrip("\n"), True)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opened_by_prompt = True


PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(sorted(PARSERS))}") from None


class ReasoningStream:
    """The reasoning and content deltas of one streamed output."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.reasoning_sent = 0
        self.content_sent = 0

    def update(self, text: str, final: bool) -> tuple[str, str, Split]:
        split = self.parser.split(text, final)
        reasoning = (split.reasoning or "")[self.reasoning_sent:]
        content = split.content[self.content_sent:]
        self.reasoning_sent += len(reasoning)
        self.content_sent += len(content)
        return reasoning, content, split
