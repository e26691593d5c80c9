"""Logprobs in the two OpenAI shapes: completions' parallel lists and chat's
list of token objects. `decode` names one token (the serving class caches it)."""

from __future__ import annotations

import math
from collections.abc import Callable

from tokenmill.engine.outputs import CompletionOutput
from tokenmill.server import protocol as p

MIN_LOGPROB = -9999.0  # JSON has no -inf

Decode = Callable[[int], str]


def clamp(logprob: float | None) -> float:
    if logprob is None or math.isnan(logprob):
        return MIN_LOGPROB
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(choice: CompletionOutput, start: int, text_offset: int,
                        decode: Decode) -> p.CompletionLogprobs:
    """The tokens of `choice` from index `start` on; `text_offset` is where the
    first of them begins in the text sent so far."""
    lp = p.CompletionLogprobs()
    for tid, entry in zip(choice.token_ids[start:], (choice.logprobs or [])[start:]):
        token = decode(tid)
        lp.tokens.append(token)
        lp.token_logprobs.append(clamp(entry[tid].logprob) if tid in entry else None)
        lp.top_logprobs.append({decode(t): clamp(v.logprob) for t, v in entry.items()})
        lp.text_offset.append(text_offset)
        text_offset += len(token)
    return lp


def chat_logprobs(choice: CompletionOutput, start: int, top_k: int,
                  decode: Decode) -> p.ChatLogprobs:
    content = []
    for tid, entry in zip(choice.token_ids[start:], (choice.logprobs or [])[start:]):
        token = decode(tid)
        chosen = entry.get(tid)
        top = sorted(((t, v) for t, v in entry.items() if (v.rank or 0) <= top_k),
                     key=lambda kv: kv[1].rank or 0)[:top_k]
        content.append(p.ChatTokenLogprob(
            token=token, logprob=clamp(chosen.logprob if chosen else None),
            bytes=list(token.encode("utf-8")),
            top_logprobs=[p.TopLogprob(token=decode(t), logprob=clamp(v.logprob),
                                       bytes=list(decode(t).encode("utf-8")))
                          for t, v in top]))
    return p.ChatLogprobs(content=content)
