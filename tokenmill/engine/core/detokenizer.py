"""Incremental detokenization for streaming (the vLLM / HF TextStreamer way).

Each step decodes a short window of token ids twice, once ending before the
new tokens and once after, and emits the difference. The window starts a few
tokens back so that tokenizers that drop a leading space at the start of a
decode (SentencePiece) or merge bytes across tokens (byte-level BPE) give the
same text as one decode of everything. Text ending in U+FFFD is an incomplete
UTF-8 character: it is held back until the next token completes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.engine.core.outputs import Logprob
from tokenmill.sequence import Sequence

# How many prompt tokens the first window reaches back (vLLM uses 5).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokState:
    prefix_offset: int  # the window starts here in seq.token_ids
    read_offset: int  # token ids before this are in seq.output_text
    prefix_text: str  # decode of token_ids[prefix_offset:read_offset]


class Detokenizer:
    """Appends each sequence's new text to `seq.output_text`; its state lives
    in `seq.detok_state`. Works with any HF tokenizer that has `decode`."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # A fast tokenizer without tokenization-space cleanup decodes exactly as its Rust
        # backend does: call that directly, twice a token, without transformers' Python
        # around it (argument conversion, batching checks: about half of a decode's time)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleanup = getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._backend_decode = getattr(backend, "decode", None) if not cleanup else None

    def decode(self, seq: Sequence, end: int | None = None) -> int:
        """Decode `seq.token_ids[:end]` past what is already text (default: all)
        and append the new text, minus an incomplete trailing character.
        Returns the number of characters appended."""
        end = len(seq.token_ids) if end is None else end
        state = self._state(seq)
        if end <= state.read_offset:
            return 0
        new_text = self._decode(seq, state.prefix_offset, end)
        if len(new_text) <= len(state.prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return 0  # nothing yet (skipped special token) or half a character
        return self._emit(seq, state, new_text, end)

    def flush(self, seq: Sequence, end: int | None = None) -> int:
        """At the end of a sequence: append whatever is still held back, even
        an incomplete character (as U+FFFD, which is what a full decode gives)."""
        end = len(seq.token_ids) if end is None else end
        state = self._state(seq)
        if end <= state.read_offset:
            return 0
        new_text = self._decode(seq, state.prefix_offset, end)
        if len(new_text) <= len(state.prefix_text):
            return 0
        return self._emit(seq, state, new_text, end)

    def decode_logprob_tokens(self, logprobs: dict[int, Logprob]) -> None:
        """Fill in `decoded_token` for each entry (the token's text on its own)."""
        for token_id, entry in logprobs.items():
            entry.decoded_token = self.tokenizer.decode([token_id])

    def _state(self, seq: Sequence) -> DetokState:
        if seq.detok_state is None:
            read = seq.num_prompt_tokens
            prefix = max(0, read - _PROMPT_CONTEXT_TOKENS)
            seq.detok_state = DetokState(prefix, read, self._decode(seq, prefix, read))
        return seq.detok_state

    def _decode(self, seq: Sequence, start: int, end: int) -> str:
        if start >= end:
            return ""
        skip = seq.sampling_params.skip_special_tokens
        if self._backend_decode is not None:
            return self._backend_decode(seq.token_ids[start:end], skip_special_tokens=skip)
        return self.tokenizer.decode(seq.token_ids[start:end], skip_special_tokens=skip)

    def _emit(self, seq: Sequence, state: DetokState, new_text: str, end: int) -> int:
        delta = new_text[len(state.prefix_text):]
        seq.output_text += delta
        # The next window starts at the old read offset, whose text is complete.
        # Its text is decoded afresh, not taken from `delta`: a window's first
        # token may decode differently (a SentencePiece leading space is dropped).
        state.prefix_offset, state.read_offset = state.read_offset, end
        state.prefix_text = self._decode(seq, state.prefix_offset, end)
        return len(delta)
