"""Logprobs in the two OpenAI shapes: completions' parallel lists and chat's
list of token objects. `decode` names one token (the serving class caches it)."""

from __future__ import annotations

import math
from collections.abc import Callable

from tokenmill.engine.core.outputs import CompletionOutput
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


def echoed_prompt_logprobs(prompt_ids: list[int], prompt_logprobs: list | None,
                           decode: Decode) -> p.CompletionLogprobs:
    """The prompt's tokens in completions' shape, as OpenAI's echo returns them:
    the first token has no logprob (None), the rest their logprob and top k."""
    lp = p.CompletionLogprobs()
    text_offset = 0
    for i, tid in enumerate(prompt_ids):
        token = decode(tid)
        entry = prompt_logprobs[i] if prompt_logprobs and i < len(prompt_logprobs) else None
        lp.tokens.append(token)
        lp.text_offset.append(text_offset)
        text_offset += len(token)
        if entry is None:
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            continue
        lp.token_logprobs.append(clamp(entry[tid].logprob) if tid in entry else None)
        lp.top_logprobs.append({decode(t): clamp(v.logprob) for t, v in entry.items()})
    return lp


def joined(first: p.CompletionLogprobs, then: p.CompletionLogprobs) -> p.CompletionLogprobs:
    return p.CompletionLogprobs(text_offset=first.text_offset + then.text_offset,
                                token_logprobs=first.token_logprobs + then.token_logprobs,
                                tokens=first.tokens + then.tokens,
                                top_logprobs=first.top_logprobs + then.top_logprobs)


def vllm_prompt_logprobs(prompt_logprobs: list | None, decode: Decode
                         ) -> list[dict[str, p.PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token {token id: logprob, rank, text}."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(t): p.PromptLogprob(logprob=clamp(v.logprob), rank=v.rank,
                                     decoded_token=decode(t)) for t, v in entry.items()}
            for entry in prompt_logprobs]
