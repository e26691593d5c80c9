"""llama-perplexity's chunking (tools/perplexity/perplexity.cpp, `perplexity()` and
`kl_divergence()`), reproduced so tokenmill scores exactly the positions llama.cpp does.

The text is tokenized once (with BOS first when the vocabulary's add_bos is set); it
is cut into n_chunk = len(tokens) // n_ctx consecutive chunks of n_ctx tokens (the
tail is dropped); each chunk is evaluated from an empty cache with its first token
replaced by BOS when add_bos is set; the logits at chunk positions first = n_ctx // 2
.. n_ctx - 2 are scored against the chunk's next tokens, i.e. n_ctx - 1 - first
positions per chunk (255 for n_ctx 512).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunking:
    n_ctx: int = 512

    @property
    def first(self) -> int:
        """The first chunk position whose logits are scored."""
        return self.n_ctx // 2

    @property
    def scored_per_chunk(self) -> int:
        return self.n_ctx - 1 - self.first

    def n_chunks(self, n_tokens: int) -> int:
        return n_tokens // self.n_ctx

    def chunks(self, tokens: list[int], bos_id: int | None) -> list[list[int]]:
        """The token sequences llama-perplexity evaluates (BOS over each chunk's first
        token when `bos_id` is given, i.e. when the vocabulary adds BOS)."""
        out = []
        for i in range(self.n_chunks(len(tokens))):
            chunk = list(tokens[i * self.n_ctx:(i + 1) * self.n_ctx])
            if bos_id is not None:
                chunk[0] = bos_id
            out.append(chunk)
        return out

    def scored(self, n_tokens: int) -> list[tuple[int, int]]:
        """(logit position, predicted token position) in the whole token stream, for
        every scored position in order: the logits computed at stream position p (in
        its chunk's own evaluation) predict the token at p + 1."""
        out = []
        for i in range(self.n_chunks(n_tokens)):
            start = i * self.n_ctx
            for pos in range(self.first, self.n_ctx - 1):
                out.append((start + pos, start + pos + 1))
        return out
