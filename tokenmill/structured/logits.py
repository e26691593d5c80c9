"""The sampler's one batched constraint pass, before penalties and sampling.

For the rows of a batch that carry constraints, in this order:
  logit_bias (added) -> allowed_token_ids (all others -inf) -> bad_words
  (their last token -inf where the rest already matches) -> the grammar
  bitmask (one (N, ceil(V/32)) int32 mask per step whose G grammar rows are
  filled by xgrammar's batch matcher and applied in one native call:
  kernels/token_bitmask.c on the CPU, xgrammar's kernel on CUDA),
so a grammar always wins over a bias. Rows without constraints are not
touched: their tokens are the same as in a batch of their own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence as SequenceLike
from typing import Any

import torch

from tokenmill.kernels import token_bitmask
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence
from tokenmill.structured.compiler import GrammarCache
from tokenmill.structured.matcher import SequenceGrammar

logger = logging.getLogger(__name__)


class LogitsConstraints:
    def __init__(self, grammars: GrammarCache) -> None:
        self.grammars = grammars
        self._batch_matcher: Any = None
        self._bitmasks: dict[int, torch.Tensor] = {}

    def apply(self, logits: torch.Tensor, seqs: SequenceLike[Sequence]) -> torch.Tensor:
        """logits (N, V) -> constrained logits (a copy; the input if no row is constrained)."""
        rows = [i for i, s in enumerate(seqs) if s.sampling_params.has_logit_constraints]
        if not rows:
            return logits
        raw = logits
        logits = logits.clone()
        self._bias(logits, seqs, rows)
        self._allowed(logits, seqs, rows)
        self._bad_words(logits, seqs, rows)
        grammar_rows = [i for i in rows if seqs[i].sampling_params.structured_outputs]
        if grammar_rows:
            self._grammar(logits, seqs, grammar_rows)
        # only two kinds of ban together can leave a row with no token at all
        fragile = [i for i in rows if _num_bans(seqs[i].sampling_params) > 1]
        if fragile:
            self._never_empty(logits, raw, seqs, fragile)
        return logits

    def accept(self, seq: Sequence, token_id: int) -> bool:
        """Advance the sequence's grammar past its new token (True without a grammar)."""
        if seq.grammar is None:
            return True
        return seq.grammar.accept(token_id)

    # ---- the pieces -------------------------------------------------------------

    @staticmethod
    def _bias(logits: torch.Tensor, seqs: SequenceLike[Sequence], rows: list[int]) -> None:
        r, c, v = [], [], []
        for i in rows:
            for token_id, bias in (seqs[i].sampling_params.logit_bias or {}).items():
                r.append(i)
                c.append(token_id)
                v.append(bias)
        if r:
            dev = logits.device
            logits.index_put_((torch.tensor(r, device=dev), torch.tensor(c, device=dev)),
                              torch.tensor(v, device=dev, dtype=logits.dtype), accumulate=True)

    @staticmethod
    def _allowed(logits: torch.Tensor, seqs: SequenceLike[Sequence], rows: list[int]) -> None:
        limited = [i for i in rows if seqs[i].sampling_params.allowed_token_ids is not None]
        if not limited:
            return
        dev = logits.device
        banned = torch.ones((len(limited), logits.shape[1]), dtype=torch.bool, device=dev)
        r = [k for k, i in enumerate(limited)
             for _ in seqs[i].sampling_params.allowed_token_ids or ()]
        c = [t for i in limited for t in seqs[i].sampling_params.allowed_token_ids or ()]
        banned[torch.tensor(r, device=dev), torch.tensor(c, device=dev)] = False
        index = torch.tensor(limited, device=dev)
        logits[index] = logits[index].masked_fill(banned, float("-inf"))

    @staticmethod
    def _bad_words(logits: torch.Tensor, seqs: SequenceLike[Sequence], rows: list[int]) -> None:
        r, c = [], []
        for i in rows:
            words = seqs[i].sampling_params.bad_words_token_ids
            if not words:
                continue
            out = seqs[i].output_token_ids
            for word in words:
                prefix = word[:-1]
                if not prefix or out[len(out) - len(prefix):] == prefix:
                    r.append(i)
                    c.append(word[-1])
        if r:
            dev = logits.device
            logits[torch.tensor(r, device=dev), torch.tensor(c, device=dev)] = float("-inf")

    def _grammar(self, logits: torch.Tensor, seqs: SequenceLike[Sequence],
                 rows: list[int]) -> None:
        import xgrammar as xgr

        matchers = []
        for i in rows:
            seq = seqs[i]
            if seq.grammar is None:
                # admitted only once compiled (LLMEngine), so this never waits
                compiled = self.grammars.submit(seq.sampling_params.structured_outputs).result()
                seq.grammar = SequenceGrammar(compiled)
            seq.grammar.sync(seq.output_token_ids)
            matchers.append(seq.grammar.matcher)
        # one row per batch row (xgrammar's kernels index the mask by the logits' row);
        # only the grammar rows are filled and applied
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=_fill_threads())
        self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        self._bitmasks = {i: bitmask[i] for i in rows}  # for _never_empty, this step only
        # on the CPU ours (whole words at a time: 0.1 ms where xgrammar's bit-by-bit
        # kernel took 2.4 ms for 16 rows of sparse JSON masks), else xgrammar's
        if not token_bitmask.apply_(logits, bitmask, rows):
            xgr.apply_token_bitmask_inplace(
                logits, bitmask.to(logits.device, non_blocking=True), indices=rows)

    def _never_empty(self, logits: torch.Tensor, raw: torch.Tensor,
                     seqs: SequenceLike[Sequence], rows: list[int]) -> None:
        """A row whose constraints together ban every token (say allowed_token_ids
        outside the grammar) falls back to its grammar alone, not to NaNs."""
        index = torch.tensor(rows, device=logits.device)
        empty = ~torch.isfinite(logits[index]).any(dim=-1)
        if not bool(empty.any()):
            return
        for i in index[empty].tolist():
            logger.warning("the constraints of a sequence ban every token; using its "
                           "grammar alone for this step")
            logits[i] = raw[i]
            mask = self._bitmasks.get(i) if seqs[i].sampling_params.structured_outputs else None
            if mask is not None:
                allowed = _allowed(mask[None].to(logits.device), logits.shape[1])[0]
                logits[i].masked_fill_(~allowed, float("-inf"))


_BITS = torch.ones(32, dtype=torch.int32) << torch.arange(32, dtype=torch.int32)


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's packed bitmask (G, ceil(V/32)) int32 -> allowed tokens (G, V) bool."""
    bits = _BITS.to(bitmask.device)
    return ((bitmask[:, :, None] & bits) != 0).view(bitmask.shape[0], -1)[:, :vocab]


def _fill_threads() -> int:
    """Threads for the batch mask fill. Filling a mask is microseconds per sequence
    in the common states, so on a small CPU extra threads only contend with torch's."""
    cpus = os.cpu_count() or 1
    return 1 if cpus <= 4 else min(8, cpus // 2)


def _num_bans(p: SamplingParams) -> int:
    return ((p.structured_outputs is not None) + (p.allowed_token_ids is not None)
            + bool(p.bad_words_token_ids))
