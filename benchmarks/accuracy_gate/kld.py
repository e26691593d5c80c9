"""Per-position figures of a path against a reference, as llama-perplexity defines
them (perplexity.cpp `log_softmax(..., kl_divergence_result &)`):

  KLD  = sum over the vocabulary of p_ref * (log p_ref - log p), only over tokens
         whose reference log-prob is above -16 (llama.cpp skips the rest: they add
         at most vocab * e^-16 of probability mass);
  NLL  = -log p(true next token), of the path and of the reference (perplexity is
         exp of their mean; the ratio of perplexities exp of their mean difference);
  same top = argmax of the path's logits == argmax of the reference's.

llama.cpp stores the reference log-probs as uint16 per token (`log_softmax(...,
uint16_t *)`): a row of 2 floats (scale, min log-prob) then round((logit - min_logit)
/ scale), min_logit clamped to max_logit - 16; `decode_llama_row` undoes that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LOGP_FLOOR = -16.0


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kld_rows(ref_logp: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """KL(ref || path) per row from log-probabilities (float64 out), llama.cpp's
    definition: tokens with ref log-prob <= -16 are left out."""
    ref = np.asarray(ref_logp, dtype=np.float64)
    cur = np.asarray(logp, dtype=np.float64)
    keep = ref > LOGP_FLOOR
    terms = np.where(keep, np.exp(np.where(keep, ref, 0.0)) * (ref - cur), 0.0)
    return terms.sum(axis=-1)


@dataclass
class PositionFigures:
    """One row per scored position (float64 / bool arrays of equal length)."""

    kld: np.ndarray
    nll: np.ndarray
    nll_ref: np.ndarray
    same_top: np.ndarray

    @staticmethod
    def of(ref_logp: np.ndarray, logp: np.ndarray, targets: np.ndarray) -> PositionFigures:
        rows = np.arange(len(targets))
        ref = np.asarray(ref_logp, dtype=np.float64)
        cur = np.asarray(logp, dtype=np.float64)
        return PositionFigures(
            kld=kld_rows(ref, cur),
            nll=-cur[rows, targets],
            nll_ref=-ref[rows, targets],
            same_top=cur.argmax(axis=-1) == ref.argmax(axis=-1),
        )

    @staticmethod
    def concat(parts: list[PositionFigures]) -> PositionFigures:
        return PositionFigures(*(np.concatenate([getattr(p, f) for p in parts])
                                 for f in ("kld", "nll", "nll_ref", "same_top")))


def llama_row_width(n_vocab: int) -> int:
    """uint16 entries per position in llama.cpp's log-prob file (`nv` there)."""
    return 2 * ((n_vocab + 1) // 2) + 4


def decode_llama_rows(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """llama.cpp's uint16 log-prob rows (n, nv) -> float32 log-probs (n, n_vocab)."""
    rows = np.ascontiguousarray(rows, dtype=np.uint16)
    head = rows[:, :4].copy().view(np.float32)  # (n, 2): scale, min log-prob
    scale, min_logp = head[:, :1], head[:, 1:2]
    return scale * rows[:, 4:4 + n_vocab].astype(np.float32) + min_logp
