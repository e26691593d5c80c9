"""The one interface every proposer implements."""

from __future__ import annotations

from typing import Protocol

from tokenmill.sequence import Sequence


class Proposer(Protocol):
    # below this exponentially weighted acceptance rate a sequence stops
    # proposing for a while: a cheap proposer (n-gram) pays at lower rates
    # than one that runs a model
    min_acceptance: float
    # True when proposing costs time even if nothing is accepted (a draft model):
    # then a fresh sequence starts from the engine-wide acceptance, so that a
    # proposer that fails for everyone is not probed again by each new request
    runs_a_model: bool

    def propose(self, seqs: list[Sequence], k: list[int]) -> list[list[int]]:
        """At most k[i] draft tokens to follow `seqs[i].token_ids`, per sequence
        (an empty list: no proposal). Called for decoding sequences whose KV
        slots already cover positions up to `num_computed_tokens + k[i]`.
        Proposals must be deterministic (see verify.py)."""
        ...

    def forget(self, seqs: list[Sequence]) -> None:
        """The sequences finished, were aborted or preempted: drop their state."""
        ...
