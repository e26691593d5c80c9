"""A step's sampled tokens into their sequences: appended, checked against the
grammar, their logprobs detokenized, stops checked, counted."""

from __future__ import annotations

import logging
import time
from typing import Any

from tokenmill.engine.core.detokenizer import Detokenizer
from tokenmill.engine.core.stats import EngineStats
from tokenmill.engine.core.stop_checker import StopChecker
from tokenmill.sequence import Sequence

logger = logging.getLogger("tokenmill.engine.core.llm_engine")

# (sequence, the tokens it emits this step, their logprobs entries)
Emitted = list[tuple[Sequence, list[int], list]]


def append_tokens(emitted: Emitted, constraints: Any, detokenizer: Detokenizer | None,
                  stop_checker: StopChecker, stats: EngineStats) -> None:
    now = time.monotonic()
    for seq, token_ids, token_logprobs in emitted:
        for token_id, logprobs in zip(token_ids, token_logprobs):
            seq.append_token(token_id)
            if not constraints.accept(seq, token_id):
                # the mask allowed only what the grammar accepts: a bug if reached
                logger.error("%r: token %d breaks its grammar; stopping it", seq, token_id)
                seq.finish("abort")
            if logprobs is not None:
                if detokenizer is not None:
                    detokenizer.decode_logprob_tokens(logprobs)
                seq.output_logprobs.append(logprobs)
                seq.cumulative_logprob += logprobs[token_id].logprob
            if seq.first_token_time is None:
                seq.first_token_time = now
            stop_checker.check(seq)
            stats.generation_tokens += 1
            if seq.is_finished:
                break
