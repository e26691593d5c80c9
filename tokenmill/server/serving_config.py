"""What `tokenmill serve` flags change in the responses: a plain dataclass in a
module of its own, so the serve command builds it (and refuses bad flags)
without importing the server stack before the engine core is spawned."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_RESPONSES = 1024  # --responses-store-size


@dataclass
class ServingConfig:
    """What `tokenmill serve` flags change in the responses."""

    # usage.prompt_tokens_details.cached_tokens; on by default (vLLM: off unless
    # --enable-prompt-tokens-details) because OpenAI always sends it
    enable_prompt_tokens_details: bool = True
    tokenizer_workers: int = 2  # threads that tokenize, render and detokenize
    metrics_prefix: str = "tokenmill"  # or "vllm": vLLM's metric names and labels
    # --generation-config: sampling defaults for the fields a request leaves unset
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # --chat-template: replaces the model's own
    # --chat-template-content-format: how message content reaches the template
    chat_template_content_format: str = "auto"  # auto | string | openai
    # --enable-auto-tool-choice --tool-call-parser NAME: parse tool_choice "auto" output
    tool_call_parser: str | None = None
    allow_unknown_fields: bool = False  # --allow-unknown-fields: ignore them, with a warning
    log_prompts: bool = False  # --log-prompts: prompt text in the log (never otherwise)
    # --reasoning-parser NAME: <think> spans become reasoning_content / reasoning items
    reasoning_parser: str | None = None
    responses_store_size: int = DEFAULT_MAX_RESPONSES  # --responses-store-size
