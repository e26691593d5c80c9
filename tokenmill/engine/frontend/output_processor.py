"""The front end's half of each step: token ids from the core become text.

Each request keeps a shadow `Sequence` per sample in the front end; the new
token ids of a step are appended to it one by one and run through the same
`StopChecker` + `Detokenizer` the in-process engine uses, so the text, the
`stop` strings and the finish reasons are the ones `LLMEngine` would give.
The core does not detokenize: it finishes on EOS, stop tokens and lengths
itself; a `stop` string is found here, and the request is then aborted in
the core (`RequestState.needs_core_abort`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from tokenmill.engine.core.detokenizer import Detokenizer
from tokenmill.engine.core.output_builder import build_request_output
from tokenmill.engine.core.outputs import RequestOutput
from tokenmill.engine.core.stop_checker import StopChecker
from tokenmill.engine.frontend.core_messages import RequestDelta
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = arrival_time
        self.seqs = [Sequence(request_id, prompt_token_ids, params, index=i,
                              arrival_time=arrival_time) for i in range(params.n)]
        self.num_cached_tokens = 0
        self.first_scheduled_time: float | None = None
        self.core_finished = False
        self.prompt_logprobs: list | None = None
        self.kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def needs_core_abort(self) -> bool:
        """Finished here (a stop string) while the core still generates for it."""
        return self.finished and not self.core_finished


class OutputProcessor:
    def __init__(self, tokenizer: object, eos_token_ids: Iterable[int],
                 max_model_len: int) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.stop_checker = StopChecker(eos_token_ids, max_model_len, self.detokenizer)

    def process(self, state: RequestState, delta: RequestDelta) -> RequestOutput:
        """Apply one step's delta; the request's cumulative output so far."""
        state.num_cached_tokens = delta.num_cached_tokens
        state.first_scheduled_time = delta.first_scheduled_time
        state.core_finished = delta.finished
        if delta.kv_transfer_params is not None:
            state.kv_transfer_params = delta.kv_transfer_params
        if delta.prompt_logprobs is not None:
            for entry in delta.prompt_logprobs:
                if entry is not None:
                    self.detokenizer.decode_logprob_tokens(entry)
            state.prompt_logprobs = delta.prompt_logprobs
        for d in delta.seqs:
            seq = state.seqs[d.index]
            logprobs = d.new_logprobs or [None] * len(d.new_token_ids)
            for token_id, lp in zip(d.new_token_ids, logprobs):
                if seq.is_finished:  # tokens past a stop string the core had not seen
                    break
                seq.append_token(token_id)
                if lp is not None:
                    self.detokenizer.decode_logprob_tokens(lp)
                    seq.output_logprobs.append(lp)
                    seq.cumulative_logprob += lp[token_id].logprob
                if seq.first_token_time is None:
                    # stamped here, where the token leaves for the client (as vLLM's
                    # front end does), not when the core produced it: TTFT then
                    # includes the hop between the processes, as the client sees it
                    seq.first_token_time = time.monotonic()
                self.stop_checker.check(seq)
            if d.finish_reason is not None and not seq.is_finished:
                # the core ended it for a reason the shadow cannot see (abort)
                self.detokenizer.flush(seq)
                seq.finish(d.finish_reason, d.stop_reason)
        return self.output(state)

    @staticmethod
    def output(state: RequestState) -> RequestOutput:
        return build_request_output(
            state.request_id, state.prompt, state.prompt_token_ids, state.seqs, state.params,
            finished=state.finished, num_cached_tokens=state.num_cached_tokens,
            arrival_time=state.arrival_time, first_scheduled_time=state.first_scheduled_time,
            prompt_logprobs=state.prompt_logprobs, kv_transfer_params=state.kv_transfer_params)
