"""A saved fast tokenizer (tokenizer.json + tokenizer_config.json), read with the Rust
`tokenizers` library alone, with the face of transformers' PreTrainedTokenizerFast
that tokenmill reads: encode, decode, the special tokens, the vocabulary and
`apply_chat_template` (rendered by loaders/chat_render.py).

The server's front end tokenizes with this: importing transformers cost it ~1.5 s of
CPU at start-up (and, through its chat-template helpers, PIL), for a tokenizer
whose every call goes to the Rust backend anyway (issue 60). It stands in for
`PreTrainedTokenizerFast(tokenizer_file=..., **config)` only where that is all the
config asks for: `from_saved` returns None for a config key it does not know
(e.g. `add_bos_token`, which transformers applies by rewriting the post-processor),
and the caller then loads transformers' own. tests/server/test_chat_render.py holds
both equal on the real tokenizers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tokenmill.loaders.chat_render import render_chat

# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES), in its order
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
# tokenizer_config.json keys that change nothing this class does: they describe the
# save, or padding / truncation / model inputs, which tokenmill never asks for
_INERT_KEYS = {"backend", "is_local", "local_files_only", "tokenizer_class", "auto_map",
               "name_or_path", "model_max_length", "padding_side", "truncation_side",
               "model_input_names", "added_tokens_decoder", "chat_template",
               "clean_up_tokenization_spaces", *SPECIAL_TOKEN_NAMES}
# keys that change nothing at these values
_INERT_VALUES = {"add_prefix_space": (None,), "split_special_tokens": (False,),
                 "additional_special_tokens": ([],), "extra_special_tokens": ({}, [])}
# apply_chat_template arguments that only shape a tokenized result
_TOKENIZE_ONLY = ("return_dict", "return_tensors", "padding", "truncation", "max_length",
                  "tokenizer_kwargs")
# longer decodes go through decode_batch, which releases the GIL (a short one is
# cheaper in one call)
_GIL_FREE_DECODE_TOKENS = 256
# transformers' clean-up after decode (WordPiece-era; it skips BPE models)
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
             (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def unsupported_keys(config: dict[str, Any]) -> list[str]:
    """tokenizer_config.json keys whose effect this class does not reproduce."""
    return sorted(k for k, v in config.items()
                  if k not in _INERT_KEYS and v not in _INERT_VALUES.get(k, ()))


def _token_text(value: Any) -> str | None:
    """A special token as the config gives it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class FastTokenizer:
    # Calls only read the Rust tokenizer (transformers reconfigures truncation and
    # padding on it per call, a mutable borrow: "Already borrowed" across threads), so
    # threads may share one: the server's tokenizer pool makes no copies of it
    thread_safe = True

    def __init__(self, backend: Tokenizer, config: dict[str, Any],
                 chat_template: str | None = None, name_or_path: str = "") -> None:
        self.backend_tokenizer = backend
        self.name_or_path = name_or_path
        self.chat_template = chat_template or config.get("chat_template")
        self.special_tokens_map: dict[str, str] = {
            name: text for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(config.get(name))) is not None}
        is_bpe = type(backend.model).__name__ == "BPE"  # transformers skips the clean-up
        self.clean_up_tokenization_spaces = bool(
            config.get("clean_up_tokenization_spaces", False)) and not is_bpe
        # as transformers 5: the named special tokens, first mention first
        self.all_special_tokens: list[str] = list(dict.fromkeys(self.special_tokens_map.values()))
        self.all_special_ids: list[int] = [i for t in self.all_special_tokens
                                           if (i := backend.token_to_id(t)) is not None]

    @classmethod
    def from_saved(cls, directory: Path, chat_template: str | None = None
                   ) -> FastTokenizer | None:
        """The tokenizer saved in `directory`, or None where its config asks for
        something only transformers does (the caller loads transformers' then)."""
        config = json.loads((directory / "tokenizer_config.json").read_text())
        if unsupported_keys(config):
            return None
        backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
        return cls(backend, config, chat_template, str(directory))

    def __getattr__(self, name: str) -> Any:
        # bos_token_id, eos_token_id, ...: the id of each named special token
        if name.endswith("_token_id") and name[:-3] in SPECIAL_TOKEN_NAMES:
            text = self.special_tokens_map.get(name[:-3])
            return None if text is None else self.backend_tokenizer.token_to_id(text)
        if name in SPECIAL_TOKEN_NAMES:
            return self.special_tokens_map.get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the batch call, as transformers makes it: it releases the GIL, `encode` holds it
        # (a 3.6 MB text: the event loop stalled 7.1 s beside `encode`, 0.15 s beside this)
        return self.backend_tokenizer.encode_batch(
            [text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if len(ids) > _GIL_FREE_DECODE_TOKENS:  # the batch call releases the GIL
            text = self.backend_tokenizer.decode_batch(
                [ids], skip_special_tokens=skip_special_tokens)[0]
        else:
            text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def apply_chat_template(self, conversation: list[Any], tools: list[dict] | None = None,
                            documents: list[dict] | None = None,
                            chat_template: str | None = None,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int]:
        """transformers' apply_chat_template for one conversation: the text, or (tokenize)
        its token ids without added special tokens (the template writes them)."""
        # how transformers would shape a tokenized result: nothing to do for text, and
        # for ids this returns the plain list (tokenmill's callers never ask for more)
        for name in _TOKENIZE_ONLY:
            if kwargs.pop(name, None) and tokenize:
                raise ValueError(f"apply_chat_template: {name} is not supported here")
        for name in ("return_assistant_tokens_mask", "sanitize_control_tokens"):
            if kwargs.pop(name, None):
                raise ValueError(f"apply_chat_template: {name} is not supported here")
        template = self._template(chat_template, tools)
        text = render_chat(template, conversation, self.special_tokens_map, tools=tools,
                           documents=documents, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self, chat_template: str | None, tools: list[dict] | None) -> str:
        own = self.chat_template
        if isinstance(own, dict):  # named templates
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                name = "tool_use" if tools is not None and "tool_use" in own else "default"
                if name not in own:
                    raise ValueError("This model has multiple chat templates with no default "
                                     f"specified; named ones: {sorted(own)}")
                return own[name]
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError("Cannot use apply_chat_template because this processor does not "
                             "have a chat template.")
        return own
