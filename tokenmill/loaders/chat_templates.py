"""Chat templates for GGUF files that carry none (tokenizer.chat_template absent).

The gemma3-270m Q4_K_M file has no template; a user of it expects Gemma's own turn
format, as llama.cpp applies its built-in `gemma` template to such a file. The
template below is Google's Gemma 3 template (tokenizer_config.json of the released
checkpoints), text-only: an image part is refused by name. --chat-template still
overrides it (server/chat_template.py).
"""

from __future__ import annotations

from typing import Any

GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- else -%}"
    "{{ raise_exception('content part of type ' + item['type'] + ' is not supported: "
    "tokenmill runs the text model of Gemma 3, image inputs are refused') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{ raise_exception('Invalid content type') }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# GGUF general.architecture -> the template a file of it gets when it has none
_DEFAULT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}


def default_chat_template(gguf_architecture: str | None) -> str | None:
    return _DEFAULT_TEMPLATES.get(gguf_architecture or "")


def fill_missing_chat_template(tokenizer: Any, gguf_architecture: str | None) -> None:
    """Give a tokenizer without a chat template its architecture's default, if any."""
    template = default_chat_template(gguf_architecture)
    if template is not None and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
