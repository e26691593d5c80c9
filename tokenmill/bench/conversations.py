"""Conversation workloads: multi-turn chat and the agentic shape, seeded or from ShareGPT.

A conversation is one `BenchRequest` with follow-ups. The load generator sends turn
k+1 when turn k has finished, its prompt being every earlier message plus the server's
actual reply, so the server's prefix cache is exercised the way a chat app exercises it
(each turn re-sends the whole history). Only user messages are drawn here; their exact
token counts are those of each message alone.

- `multiturn`: `--turns` turns (default 4), each user message `--input-len` tokens, each
  reply `--output-len` tokens; no system prompt.
- `agentic`: one system (tool-definition) prompt of `--prefix-len` tokens shared by every
  conversation, then `--turns` (default 8) short turns of `--input-len` / `--output-len`.
- `sharegpt` with `--turns N` > 1: up to N human turns of each conversation, the
  matching replies' lengths as output lengths, stopping before the running total passes
  `--sharegpt-max-total-len`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tokenmill.bench.prompts import (
    DEFAULT_TURNS,
    BenchRequest,
    FollowUp,
    WorkloadSpec,
    allowed_ids,
    need_tokenizer,
    random_text,
    token_count,
    turn_text,
)


def seeded_conversations(spec: WorkloadSpec, n: int, tokenizer,
                         rng: np.random.Generator) -> list[BenchRequest]:
    """`n` conversations of `spec.turns` turns (multiturn, or agentic with one shared
    system prompt)."""
    need_tokenizer(tokenizer, spec.dataset)
    allowed = allowed_ids(tokenizer)
    turns = spec.turns or DEFAULT_TURNS[spec.dataset]
    system = (random_text(tokenizer, spec.prefix_len, rng, allowed)[0]
              if spec.dataset == "agentic" else "")
    out = []
    for _ in range(n):
        in_lens = spec.input_len.sample(rng, turns)
        out_lens = spec.output_len.sample(rng, turns)
        users = [random_text(tokenizer, k, rng, allowed)[0] for k in in_lens]
        out.append(BenchRequest(users[0], None, out_lens[0], system=system,
                                follow_ups=tuple(FollowUp(u, o) for u, o in
                                                 zip(users[1:], out_lens[1:]))))
    return out


def sharegpt_conversations(spec: WorkloadSpec, n: int, tokenizer,
                           rng: np.random.Generator) -> list[BenchRequest]:
    need_tokenizer(tokenizer, "sharegpt")
    if not spec.dataset_path:
        raise ValueError("the sharegpt dataset needs --dataset-path FILE.json")
    data = json.loads(Path(spec.dataset_path).read_text())
    convs = [c for d in data for c in [d.get("conversations") or d.get("conversation") or []]
             if len(c) >= 2]
    fixed_out = None if spec.output_len_from_dataset else spec.output_len
    out: list[BenchRequest] = []
    for idx in rng.permutation(len(convs)):
        pairs = _pairs(convs[idx])[: spec.turns]
        turns, total = [], 0
        for user, reply in pairs:
            user_len = token_count(tokenizer, user)
            out_len = (token_count(tokenizer, reply) if fixed_out is None
                       else fixed_out.sample(rng, 1)[0])
            total += user_len + out_len
            if user_len < 4 or out_len < 1 or total > spec.sharegpt_max_total_len:
                break
            turns.append((user, out_len))
        if not turns or token_count(tokenizer, turns[0][0]) > spec.sharegpt_max_input_len:
            continue
        out.append(BenchRequest(turns[0][0], None, turns[0][1], follow_ups=tuple(
            FollowUp(u, o) for u, o in turns[1:])))
        if len(out) == n:
            return out
    if not out:
        raise ValueError(f"no conversation in {spec.dataset_path} passes the length filters")
    return [out[i % len(out)] for i in range(n)]


def _pairs(conv: list) -> list[tuple[str, str]]:
    """(user message, reply) pairs in order; a turn without a reply ends the list."""
    pairs = []
    for i in range(0, len(conv) - 1, 2):
        pairs.append((turn_text(conv[i]), turn_text(conv[i + 1])))
    return pairs
