"""After each new token: detokenize it, then decide whether the sequence ends.

One call per appended token, `StopChecker.check(seq)`, in this order (as vLLM):
1. EOS (unless `ignore_eos`) or a `stop_token_ids` token, once `min_tokens`
   outputs exist -> finish "stop"; the stop token's text is not appended
   (unless `include_stop_str_in_output`).
2. Otherwise the token's text is appended to `seq.output_text`, and the new
   text (plus enough lookback to catch a stop string split across tokens) is
   searched for `stop` strings -> finish "stop", text truncated before the
   stop string (or after it, with `include_stop_str_in_output`).
3. `max_tokens` outputs, or `max_model_len` tokens in all -> finish "length".

Streaming sends `emittable_text(seq)`: the text that can no longer turn out
to be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.engine.core.detokenizer import Detokenizer
from tokenmill.sequence import Sequence


class StopChecker:
    """Drives the detokenizer too, since stop strings are found in the text and
    a stop token's text must stay out of it. Without a detokenizer there is no
    text and `stop` strings are ignored."""

    def __init__(
        self,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        detokenizer: Detokenizer | None = None,
    ) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.detokenizer = detokenizer

    def check(self, seq: Sequence) -> None:
        """Call once after each `seq.append_token(t)`; may call `seq.finish`."""
        if seq.is_finished:
            return
        params = seq.sampling_params
        token_id = seq.last_token_id
        may_stop = seq.num_output_tokens >= params.min_tokens
        stop_token = may_stop and (
            (token_id in self.eos_token_ids and not params.ignore_eos)
            or token_id in params.stop_token_ids)
        if stop_token:
            keep = params.include_stop_str_in_output
            self._flush(seq, end=len(seq.token_ids) - (0 if keep else 1))
            is_eos = token_id in self.eos_token_ids and not params.ignore_eos
            seq.finish("stop", None if is_eos else token_id)
            return

        num_new_chars = self.detokenizer.decode(seq) if self.detokenizer else 0
        if may_stop and params.stop and num_new_chars and self._stop_string(seq, num_new_chars):
            return
        out_of_tokens = params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens
        if out_of_tokens or seq.num_tokens >= self.max_model_len:
            self._flush(seq, end=len(seq.token_ids))
            seq.finish("length")

    def _flush(self, seq: Sequence, end: int) -> None:
        if self.detokenizer is not None:
            self.detokenizer.flush(seq, end)

    @staticmethod
    def _stop_string(seq: Sequence, num_new_chars: int) -> bool:
        """Finish at the earliest stop string that overlaps the new text."""
        text = seq.output_text
        found: tuple[int, str] | None = None
        for stop in seq.sampling_params.stop:
            # Only occurrences that end inside the new text are new.
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index != -1 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return False
        index, stop = found
        keep = len(stop) if seq.sampling_params.include_stop_str_in_output else 0
        seq.output_text = text[: index + keep]
        seq.finish("stop", stop)
        return True


def emittable_text(seq: Sequence) -> str:
    """The part of `seq.output_text` that is final: all of it once finished;
    while running, all but a tail that could be the start of a stop string.
    Grows monotonically, so a server can stream its deltas."""
    text = seq.output_text
    params = seq.sampling_params
    if seq.is_finished or not params.stop or params.include_stop_str_in_output:
        return text
    held = 0
    for stop in params.stop:
        for length in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:length]):
                held = length
                break
    return text[: len(text) - held]
