"""The one RequestOutput builder: the in-process engine (from its sequences) and the
front end beside an engine core process (from its shadow sequences) both call it,
so a request's output has one shape whichever way it was served."""

from __future__ import annotations

import time
from collections.abc import Iterable

from tokenmill.engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.engine.core.stop_checker import emittable_text
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence


def build_request_output(request_id: str, prompt: str | None, prompt_token_ids: list[int],
                         seqs: Iterable[Sequence], params: SamplingParams, *, finished: bool,
                         num_cached_tokens: int, arrival_time: float,
                         first_scheduled_time: float | None,
                         prompt_logprobs: list | None,
                         kv_transfer_params: dict | None = None) -> RequestOutput:
    """The request's cumulative output so far; `seqs` are its samples (any order)."""
    seqs = sorted(seqs, key=lambda s: s.index)
    outs = [CompletionOutput(
        index=seq.index,
        text=emittable_text(seq),
        token_ids=seq.output_token_ids,
        cumulative_logprob=seq.cumulative_logprob if seq.output_logprobs else None,
        logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    ) for seq in seqs]
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        outputs=outs,
        finished=finished,
        num_cached_tokens=num_cached_tokens,
        metrics=RequestMetrics(
            arrival_time=arrival_time,
            first_scheduled_time=first_scheduled_time,
            first_token_time=min((s.first_token_time for s in seqs if s.first_token_time),
                                 default=None),
            finished_time=time.monotonic() if finished else None,
        ),
        prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
        kv_transfer_params=kv_transfer_params,
    )
