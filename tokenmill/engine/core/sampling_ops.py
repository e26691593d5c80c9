"""The sampler's row operations, public: the sampler runs them on a batch,
speculative verification (engine/speculative/verify.py) on a draft's rows, prompt
logprobs on the prompt's rows — one copy of each rule (top-k ties, top-p's
smallest set, the inverse-CDF draw, the seeded streams, the logprobs' packing).
"""

from __future__ import annotations

from collections import Counter

import torch

from tokenmill.engine.core.outputs import Logprob
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence

# A draw needs a cumulative sum over the vocabulary; doing it in two levels
# (sums of blocks, then a cumsum inside the one chosen block) keeps a
# (16, 49152) draw well under a millisecond on CPU, where a flat cumsum,
# torch.multinomial or an exponential race take several.
_CDF_BLOCK = 256
# top-p first looks at the most likely tokens only (a model's distribution
# usually reaches p within a few hundred); a full sort is the last resort.
_TOP_P_CANDIDATES = (256, 4096)


def seed_for(seed: int, index: int) -> int:
    # Distinct, reproducible streams for the n samples of one seeded request.
    return (seed * 0x9E3779B97F4A7C15 + index) % (2**63)


def has_penalty(p: SamplingParams) -> bool:
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """Repetition penalty (HF/vLLM: over prompt + output; logit > 0 is divided,
    else multiplied), then OpenAI frequency and presence penalties (output only).

    Touches only the token ids that occur, so the cost follows the sequences'
    lengths, not the vocabulary.
    """
    vocab = logits.shape[1]
    device = logits.device
    rep_rows: list[int] = []
    rep_cols: list[int] = []
    rep_vals: list[float] = []
    add_rows: list[int] = []
    add_cols: list[int] = []
    add_vals: list[float] = []
    for row, seq in zip(rows, seqs):
        p = seq.sampling_params
        if p.repetition_penalty != 1.0:
            seen = [t for t in set(seq.token_ids) if 0 <= t < vocab]
            rep_rows += [row] * len(seen)
            rep_cols += seen
            rep_vals += [p.repetition_penalty] * len(seen)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            for tok, count in Counter(seq.output_token_ids).items():
                if 0 <= tok < vocab:
                    add_rows.append(row)
                    add_cols.append(tok)
                    add_vals.append(-(p.frequency_penalty * count + p.presence_penalty))
    if rep_rows:
        r = torch.tensor(rep_rows, device=device)
        c = torch.tensor(rep_cols, device=device)
        penalty = torch.tensor(rep_vals, device=device)
        v = logits[r, c]
        logits[r, c] = torch.where(v > 0, v / penalty, v * penalty)
    if add_rows:
        r = torch.tensor(add_rows, device=device)
        c = torch.tensor(add_cols, device=device)
        logits[r, c] += torch.tensor(add_vals, device=device)


def apply_top_k(logits: torch.Tensor, top_k: list[int]) -> None:
    """Mask all but each row's k largest logits (ties with the k-th are kept)."""
    vocab = logits.shape[1]
    k = torch.tensor(top_k, device=logits.device).clamp_(1, vocab)  # (N,)
    top = logits.topk(int(k.max()), dim=-1).values  # (N, k_max), sorted descending
    kth = top.gather(1, (k - 1)[:, None])  # (N, 1)
    logits.masked_fill_(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, rows: list[int], top_p: list[float]) -> None:
    """Keep each row's smallest set of most likely tokens whose probability sum
    reaches p (at least one; ties with the last kept token are kept)."""
    vocab = logits.shape[1]
    probs = torch.softmax(logits[rows], dim=-1)  # (R, V)
    p = torch.tensor(top_p, device=logits.device)[:, None]  # (R, 1)
    for num_candidates in (*_TOP_P_CANDIDATES, vocab):
        if num_candidates >= vocab:
            vals = probs.sort(dim=-1, descending=True).values  # (R, V)
        else:
            vals = probs.topk(num_candidates, dim=-1).values  # (R, C) descending
        cum = vals.cumsum(dim=-1)
        if num_candidates >= vocab or bool((cum[:, -1:] >= p).all()):
            break
    # number of tokens needed to reach p, minus one; clamped for rounding at p=1
    last_kept = (cum < p).sum(dim=-1, keepdim=True).clamp_(max=vals.shape[1] - 1)
    threshold = vals.gather(1, last_kept)  # (R, 1)
    sub = logits[rows]
    sub.masked_fill_(probs < threshold, float("-inf"))
    logits[rows] = sub


def inverse_cdf_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row from `probs` (N, V) with the given U[0, 1) draws (N,).

    Target r = (1 - u) * total is in (0, total]; picking the first index whose
    cumulative sum is >= r can never pick a zero-probability token.
    """
    n, vocab = probs.shape
    pad = (-vocab) % _CDF_BLOCK
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    blocks = probs.view(n, -1, _CDF_BLOCK)  # (N, num_blocks, B)
    block_cum = blocks.sum(dim=-1).cumsum(dim=-1)  # (N, num_blocks)
    r = (1.0 - uniforms.to(probs.device))[:, None] * block_cum[:, -1:]  # (N, 1)
    block = torch.searchsorted(block_cum, r).clamp_(max=block_cum.shape[1] - 1)  # (N, 1)
    before = torch.where(block > 0, block_cum.gather(1, (block - 1).clamp(min=0)),
                         torch.zeros_like(r))
    in_block = blocks.gather(1, block[:, :, None].expand(n, 1, _CDF_BLOCK))[:, 0]  # (N, B)
    in_cum = in_block.cumsum(dim=-1)
    residual = torch.minimum(r - before, in_cum[:, -1:])
    offset = torch.searchsorted(in_cum, residual).clamp_(max=_CDF_BLOCK - 1)
    return (block * _CDF_BLOCK + offset)[:, 0]


def pack(
    token_ids: torch.Tensor,  # (N,) where the logits are
    logprobs: torch.Tensor | None,  # (N, V) log_softmax of the raw logits, or None
    num_logprobs: list[int | None],
) -> torch.Tensor:
    """The chosen ids and the requested logprobs in one float64 tensor (N, C), computed
    where the logits are, so that one copy brings them to the host (ids < 2^53 stay
    exact). Without logprobs: the ids as they are (no op to run: each tiny op costs
    ~30 us at batch 1 on a CPU, where the step's weights have just swept the caches)."""
    if logprobs is None:
        return token_ids
    chosen = logprobs.gather(1, token_ids[:, None])  # (N, 1)
    ranks = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1  # (N, 1)
    cols = [token_ids.double()[:, None], chosen.double(), ranks.double()]
    k_max = _k_max(num_logprobs, logprobs.shape[1])
    if k_max > 0:
        top = logprobs.topk(k_max, dim=-1)  # (N, k_max) each
        cols += [top.values.double(), top.indices.double()]
    return torch.cat(cols, dim=1)


def _k_max(num_logprobs: list[int | None], vocab: int) -> int:
    return min(max((k for k in num_logprobs if k is not None), default=0), vocab)


def unpack(host: list, num_logprobs: list[int | None]
            ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
    """`pack`'s rows (or ids), on the host, as token ids and logprobs entries."""
    if host and not isinstance(host[0], list):  # the ids alone
        return host, [None] * len(host)
    token_list = [int(row[0]) for row in host]
    if all(k is None for k in num_logprobs):
        return token_list, [None] * len(host)
    k_max = (len(host[0]) - 3) // 2 if host else 0
    out: list[dict[int, Logprob] | None] = []
    for row, k, tok in zip(host, num_logprobs, token_list):
        if k is None:
            out.append(None)
            continue
        entry = {tok: Logprob(logprob=row[1], rank=int(row[2]))}
        top_vals, top_ids = row[3:3 + k_max][:k], row[3 + k_max:][:k]
        for i, (tid, val) in enumerate(zip(top_ids, top_vals)):
            entry.setdefault(int(tid), Logprob(logprob=val, rank=i + 1))
        out.append(entry)
    return token_list, out


def fetch(
    token_ids: torch.Tensor,  # (N,) where the logits are
    logprobs: torch.Tensor | None,  # (N, V) log_softmax of the raw logits, or None
    num_logprobs: list[int | None],
) -> tuple[list[int], list[dict[int, Logprob] | None]]:
    """The chosen ids and the requested logprobs, brought to the host in one copy."""
    host = pack(token_ids, logprobs, num_logprobs).cpu().tolist()
    return unpack(host, num_logprobs)


def gather_logprobs(
    logprobs: torch.Tensor,  # (N, V) log_softmax of the raw logits
    token_ids: torch.Tensor,  # (N,)
    num_logprobs: list[int | None],
) -> list[dict[int, Logprob] | None]:
    """The logprobs entries of given tokens (speculative verification's accepted ones)."""
    return fetch(token_ids, logprobs, num_logprobs)[1]
