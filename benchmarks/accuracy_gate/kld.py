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
import torch

LOGP_FLOOR = -16.0


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kld_rows(ref_logp, logp) -> np.ndarray:
    """KL(ref || path) per row from log-probabilities (float64 out), llama.cpp's
    definition: tokens with ref log-prob <= -16 are left out. In torch (both cores;
    numpy's one-thread passes over a chunk's 255 x 49k rows took most of a path's
    scoring time on the shared machine), in float64 as before."""
    ref = torch.as_tensor(np.asarray(ref_logp) if not torch.is_tensor(ref_logp)
                          else ref_logp).double()
    cur = torch.as_tensor(np.asarray(logp) if not torch.is_tensor(logp) else logp).double()
    return _kld(ref, cur).numpy()


def _kld(ref: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    keep = ref > LOGP_FLOOR
    return torch.where(keep, ref.exp() * (ref - cur), 0.0).sum(dim=-1)


@dataclass
class PositionFigures:
    """One row per scored position (float64 / bool arrays of equal length)."""

    kld: np.ndarray
    nll: np.ndarray
    nll_ref: np.ndarray
    same_top: np.ndarray

    @staticmethod
    def of(ref_logp, logp, targets: np.ndarray) -> PositionFigures:
        ref = torch.as_tensor(np.asarray(ref_logp) if not torch.is_tensor(ref_logp)
                              else ref_logp).double()
        cur = torch.as_tensor(np.asarray(logp) if not torch.is_tensor(logp) else logp).double()
        rows = torch.arange(len(targets))
        t = torch.as_tensor(np.asarray(targets), dtype=torch.int64)
        return PositionFigures(
            kld=_kld(ref, cur).numpy(),
            nll=(-cur[rows, t]).numpy(),
            nll_ref=(-ref[rows, t]).numpy(),
            same_top=(cur.argmax(dim=-1) == ref.argmax(dim=-1)).numpy(),
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
