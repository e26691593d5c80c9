"""Prompt lookup: the k tokens that followed the latest earlier occurrence of
the sequence's last n tokens (n from ngram_max down to ngram_min), searched in
its own prompt and output. Free to run; pays on input-grounded text
(summaries, rewrites, code edits) that copies spans of the prompt."""

from __future__ import annotations

from tokenmill.sequence import Sequence


class NgramProposer:
    min_acceptance = 0.15
    runs_a_model = False  # free to propose: every request probes on its own

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4, max_lookback: int = 4096) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.max_lookback = max_lookback  # bounds the search cost on long contexts

    def propose(self, seqs: list[Sequence], k: list[int]) -> list[list[int]]:
        return [self._lookup(seq.token_ids, n) if n > 0 else [] for seq, n in zip(seqs, k)]

    def forget(self, seqs: list[Sequence]) -> None:
        pass

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        length = len(tokens)
        lo = max(0, length - self.max_lookback)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            suffix = tokens[length - n:]
            first = suffix[0]
            # latest earlier occurrence whose continuation is non-empty
            start = length - n - 1
            while start >= lo:
                try:
                    start = _rindex(tokens, first, lo, start)
                except ValueError:
                    break
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + k]
                start -= 1
        return []


def _rindex(tokens: list[int], value: int, lo: int, hi: int) -> int:
    """The largest i in [lo, hi] with tokens[i] == value (ValueError if none)."""
    for i in range(hi, lo - 1, -1):
        if tokens[i] == value:
            return i
    raise ValueError(value)
