"""llama-perplexity's --kl-divergence-base file (written by `perplexity()` when
given --kl-divergence-base without --kl-divergence):

    "_logits_"  uint32 n_ctx  int32 n_vocab  int32 n_chunk
    int32 tokens[n_ctx * n_chunk]         (the tokens it evaluated, before BOS)
    per chunk: (n_ctx - 1 - n_ctx/2) rows of nv uint16 (kld.decode_llama_rows)

so tokenmill is fed exactly llama.cpp's tokens, and llama.cpp's own per-position
log-probs (of the F32 reference and of the quantized file) can be compared here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.accuracy_gate.chunks import Chunking
from benchmarks.accuracy_gate.kld import decode_llama_rows, llama_row_width

MAGIC = b"_logits_"


@dataclass
class LlamaLogprobs:
    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray          # int32 (n_ctx * n_chunk,)
    rows: np.ndarray            # uint16 memmap (n_chunk * scored_per_chunk, nv)

    @property
    def chunking(self) -> Chunking:
        return Chunking(self.n_ctx)

    def logprobs(self, start: int, stop: int) -> np.ndarray:
        """Decoded float32 log-probs of scored positions [start, stop)."""
        return decode_llama_rows(self.rows[start:stop], self.n_vocab)

    def targets(self) -> np.ndarray:
        """The true next token of every scored position, in order."""
        ch = self.chunking
        return np.array([self.tokens[t] for _, t in ch.scored(len(self.tokens))],
                        dtype=np.int64)


def read(path: Path) -> LlamaLogprobs:
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(8) != MAGIC:
            raise ValueError(f"{path}: not a llama-perplexity log-prob file (no _logits_ magic)")
        n_ctx = int(np.frombuffer(f.read(4), np.uint32)[0])
        n_vocab, n_chunk = (int(x) for x in np.frombuffer(f.read(8), np.int32))
    header = 8 + 4 + 8
    tokens = np.memmap(path, np.int32, "r", header, (n_ctx * n_chunk,))
    per_chunk = Chunking(n_ctx).scored_per_chunk
    nv = llama_row_width(n_vocab)
    offset = header + 4 * n_ctx * n_chunk
    expected = offset + 2 * nv * per_chunk * n_chunk
    if path.stat().st_size != expected:
        raise ValueError(f"{path}: {path.stat().st_size} bytes, expected {expected} for "
                         f"{n_chunk} chunks of {n_ctx}, vocab {n_vocab}")
    rows = np.memmap(path, np.uint16, "r", offset, (per_chunk * n_chunk, nv))
    return LlamaLogprobs(path, n_ctx, n_vocab, n_chunk, np.asarray(tokens), rows)
