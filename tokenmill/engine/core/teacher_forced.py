"""Teacher-forced scoring through the real engine: every position a decode step, or
every position of one prefill.

`score_windows`: each text window becomes one request whose prompt is its first token;
every step after that the engine runs as in serving (scheduler, KV cache, attention
backend), but the token appended is the text's next token instead of a sampled one, and
the logits of that step are kept: the log-probability of the true token (for perplexity)
and the argmax (for greedy top-1 agreement between two configurations). Every position
past the first is thus scored by a decode step that reads the whole cache written so
far, which is where a quantized KV cache shows.

`score_prompts`: each window is one prompt, scored by vLLM's `prompt_logprobs` (the
true token's logprob and the top 1 at every position), so every position goes through
prompt attention instead (the tiled prompt kernel on a bf16 CPU cache, for a first
chunk and for the chunks over the cached part after it, chunked at the engine's
--max-num-batched-tokens).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from tokenmill.engine.core.sampler import SamplerOutput
from tokenmill.sampling_params import SamplingParams


@dataclass
class Scores:
    """Per window, per scored position (window token 1..n-1)."""

    logprobs: list[list[float]] = field(default_factory=list)  # of the true next token
    argmax: list[list[int]] = field(default_factory=list)  # the greedy choice

    def perplexity(self) -> float:
        flat = [lp for window in self.logprobs for lp in window]
        return float(torch.tensor(flat, dtype=torch.float64).neg().mean().exp())

    def agreement(self, other: Scores, max_positions: int | None = None) -> float:
        """Share of positions (the first `max_positions`) where both pick the same token."""
        a = [t for window in self.argmax for t in window][:max_positions]
        b = [t for window in other.argmax for t in window][:max_positions]
        assert len(a) == len(b), (len(a), len(b))
        return sum(x == y for x, y in zip(a, b)) / len(a)


class _ForcingSampler:
    """Stands in for the engine's sampler: records the step's logits, appends the text."""

    def __init__(self, windows: dict[str, list[int]], scores: dict[str, tuple[list, list]]):
        self.windows, self.scores = windows, scores

    def __call__(self, logits: torch.Tensor, seqs: Seq) -> SamplerOutput:
        logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
        best = logp.argmax(dim=-1).tolist()
        tokens = []
        for row, seq in enumerate(seqs):
            window = self.windows[seq.request_id]
            nxt = window[seq.num_tokens]  # the token the text has at this position
            lps, amax = self.scores[seq.request_id]
            lps.append(float(logp[row, nxt]))
            amax.append(best[row])
            tokens.append(nxt)
        return SamplerOutput(token_ids=tokens, logprobs=[None] * len(seqs))


def score_prompts(engine, windows: list[list[int]]) -> Scores:
    """Scores of each window's positions 1..n-1 from one prefill of the whole window
    (all windows submitted together), the same positions score_windows scores."""
    ids = {f"pf-{i}": w for i, w in enumerate(windows)}
    for rid, window in ids.items():
        engine.add_request(rid, window, SamplingParams(temperature=0.0, max_tokens=1,
                                                       prompt_logprobs=1))
    got: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.prompt_logprobs
    scores = Scores()
    for rid, window in ids.items():
        entries = got[rid]
        assert entries is not None and len(entries) == len(window), rid
        lps, amax = [], []
        for pos in range(1, len(window)):
            entry = entries[pos]  # {token: Logprob}: the true token and the top 1
            lps.append(entry[window[pos]].logprob)
            amax.append(next(t for t, lp in entry.items() if lp.rank == 1))
        scores.logprobs.append(lps)
        scores.argmax.append(amax)
    return scores


def score_windows(engine, windows: list[list[int]], score_last: int | None = None) -> Scores:
    """Teacher-forced scores of each window (all run together as one batch).

    score_last: score only each window's last N positions; the tokens before them are
    the prompt (one prefill, chunked at the engine's token budget), so a long context
    costs N decode steps, not its length."""
    forced = {f"tf-{i}": w for i, w in enumerate(windows)}
    scores: dict[str, tuple[list, list]] = {rid: ([], []) for rid in forced}
    saved = engine.sampler
    engine.sampler = _ForcingSampler(forced, scores)
    try:
        for rid, window in forced.items():
            prompt = max(1, len(window) - score_last) if score_last else 1
            engine.add_request(rid, window[:prompt], SamplingParams(
                temperature=0.0, max_tokens=len(window) - prompt, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.sampler = saved
    out = Scores()
    for rid in forced:
        out.logprobs.append(scores[rid][0])
        out.argmax.append(scores[rid][1])
    return out
