"""vLLM's `prompt_logprobs`: the logprob of every prompt token given the tokens
before it (the first has none), plus the top k at each position.

The runner computes logits only for the rows the engine names; a request
asking prompt logprobs adds the rows of its prompt positions in this step's
chunk (chunked prefill spreads them over several steps). Its prompt never
reuses prefix-cache blocks (block_manager.get_computed_blocks), as in vLLM:
a cached prefix has no logits. After a preemption the prompt is recomputed and
the positions already recorded are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from tokenmill.engine.core.outputs import Logprob
from tokenmill.engine.core.sampling_ops import gather_logprobs
from tokenmill.sequence import Sequence


@dataclass
class PromptRows:
    """The extra logit rows of one step: for each sequence, its flat-batch rows
    and the prompt positions whose next token they score."""

    rows: list[int] = field(default_factory=list)
    # (sequence, first position, number of positions), in `rows` order
    spans: list[tuple[Sequence, int, int]] = field(default_factory=list)


def prompt_rows(scheduled: Seq, recorded: dict[int, list]) -> PromptRows:
    """Rows of this step that score a prompt token not yet in `recorded`
    (seq_id -> the logprobs recorded so far, the first prompt token's None included)."""
    out = PromptRows()
    offset = 0
    for item in scheduled:
        seq, n = item.seq, item.num_new_tokens
        done = recorded.get(seq.seq_id)
        if done is not None:
            start = max(seq.num_computed_tokens, len(done) - 1)
            stop = min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1)
            if start < stop:  # position p scores prompt token p + 1
                first_row = offset + start - seq.num_computed_tokens
                out.rows.extend(range(first_row, first_row + stop - start))
                out.spans.append((seq, start, stop - start))
        offset += n
    return out


def record_prompt_logprobs(logits: torch.Tensor, rows: PromptRows, recorded: dict[int, list]) -> None:
    """Append the logprobs of `rows` (logits (len(rows.rows), V)) to `recorded`."""
    targets: list[int] = []
    ks: list[int | None] = []
    for seq, start, count in rows.spans:
        targets.extend(seq.token_ids[start + 1:start + 1 + count])
        ks.extend([seq.sampling_params.prompt_logprobs] * count)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
    token_ids = torch.tensor(targets, dtype=torch.int64, device=logits.device)
    entries: list[dict[int, Logprob] | None] = gather_logprobs(logprobs, token_ids, ks)
    i = 0
    for seq, _start, count in rows.spans:
        recorded[seq.seq_id].extend(entries[i:i + count])
        i += count
