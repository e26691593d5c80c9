"""Structured output: grammars (xgrammar) and per-token constraints.

  compiler.GrammarCache    compiles a request's constraint on a worker thread,
                           cached by the constraint, so the engine loop never waits
  matcher.SequenceGrammar  one sequence's position in its grammar
  logits.LogitsConstraints the sampler's one batched pass: grammar bitmask,
                           logit_bias, allowed_token_ids and bad_words

xgrammar is imported only when the first constrained request arrives, and
`LogitsConstraints` (torch) only when asked for: the server's front end imports the
compiler without loading torch.
"""

from typing import Any

from tokenmill.structured.compiler import GrammarCache, GrammarError

__all__ = ["GrammarCache", "GrammarError", "LogitsConstraints"]


def __getattr__(name: str) -> Any:
    if name == "LogitsConstraints":
        from tokenmill.structured.logits import LogitsConstraints

        return LogitsConstraints
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
