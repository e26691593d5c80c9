"""EngineRequest: one request inside LLMEngine — its n samples (sequences), the
siblings still to add, its grammar's compile — and the output it reads as."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from tokenmill.engine.core.output_builder import build_request_output
from tokenmill.engine.core.outputs import RequestOutput
from tokenmill.engine.core.validation import Admitted
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence


@dataclass
class EngineRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    pending_siblings: int  # n > 1: samples added once the first one's prompt is cached
    arrival_time: float
    grammar: Future | None = None  # structured outputs: its compile
    kv_transfer_params: dict | None = None  # a prefill for a remote decode: where its KV is

    @classmethod
    def start(cls, request_id: str, admitted: Admitted, arrival_time: float,
              grammar: Future | None, share_prompt: bool) -> EngineRequest:
        """share_prompt (n > 1 with prefix caching): the first sample alone now, its
        siblings once its prompt is cached; otherwise all n at once."""
        params, ids = admitted.params, admitted.prompt_token_ids
        n = params.n if not share_prompt else 1
        seqs = [Sequence(request_id, ids, params, index=i, arrival_time=arrival_time)
                for i in range(n)]
        return cls(request_id, admitted.prompt, ids, params, seqs, params.n - n,
                   arrival_time, grammar)

    @property
    def finished(self) -> bool:
        return (not self.pending_siblings and len(self.seqs) == self.params.n
                and all(s.is_finished for s in self.seqs))

    def add_siblings(self) -> list[Sequence]:
        """The samples held back until the first one's prompt blocks were cached."""
        n = self.params.n
        new = [Sequence(self.request_id, self.prompt_token_ids, self.params, index=i,
                        arrival_time=self.arrival_time)
               for i in range(n - self.pending_siblings, n)]
        self.seqs += new
        self.pending_siblings = 0
        return new

    def output(self, prompt_logprobs: list | None) -> RequestOutput:
        first = self.seqs[0]
        return build_request_output(
            self.request_id, self.prompt, self.prompt_token_ids, self.seqs, self.params,
            finished=self.finished, num_cached_tokens=first.num_cached_tokens,
            arrival_time=self.arrival_time, first_scheduled_time=first.first_scheduled_time,
            prompt_logprobs=prompt_logprobs, kv_transfer_params=self.kv_transfer_params)
