"""The chat template the server renders with: the model's own, or vLLM's
--chat-template (a file, or the template text itself), and how message
content reaches it (--chat-template-content-format)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

CONTENT_FORMATS = ("auto", "string", "openai")
# a template that loops over a message's content expects OpenAI's list of parts
_LOOPS_OVER_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+\w+(\[\s*['\"]content['\"]\s*\]|\.content\b)")

NO_TEMPLATE = ("this model has no chat template, so /v1/chat/completions cannot render "
               "messages; start the server with --chat-template FILE (a Jinja template), "
               "or send a plain prompt to /v1/completions")


def load_chat_template(arg: str | None) -> str | None:
    """vLLM's rule: a path to a file, or else the template text itself."""
    if arg is None:
        return None
    path = Path(arg).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" in arg:
        return arg
    raise ValueError(f"--chat-template {arg!r}: no such file, and not a Jinja template")


def content_format(option: str, template: str | None) -> str:
    """`auto` picks "openai" for a template that loops over content, else "string"."""
    if option not in CONTENT_FORMATS:
        raise ValueError(f"--chat-template-content-format must be one of {CONTENT_FORMATS}")
    if option != "auto":
        return option
    return "openai" if template and _LOOPS_OVER_CONTENT.search(template) else "string"


def template_of(tokenizer: Any, override: str | None) -> str | None:
    return override or getattr(tokenizer, "chat_template", None) or None
