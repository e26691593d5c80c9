"""One sequence's position in its grammar: an xgrammar matcher that has
accepted exactly the sequence's output tokens."""

from __future__ import annotations

from typing import Any


class SequenceGrammar:
    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        ok = self.matcher.accept_token(token_id)
        if ok:
            self.num_accepted += 1
        return ok

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the matcher's state that of these outputs. A no-op in the normal
        flow (each appended token was accepted); a replay from the start if any
        path ever appended or removed tokens behind its back."""
        if self.num_accepted == len(output_token_ids):
            return
        self.matcher.reset()
        self.num_accepted = 0
        for token_id in output_token_ids:
            if not self.accept(token_id):
                break

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
