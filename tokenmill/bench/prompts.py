"""The pieces every workload is made of: a request (or conversation), token lengths,
exact-length random text, and the workload's spec. Dataset builders are in workload.py
(single requests) and conversations.py (multi-turn).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_TURNS = {"multiturn": 4, "agentic": 8}


@dataclass(frozen=True)
class FollowUp:
    """A later turn of a conversation: the user's next message and its output length."""

    user: str
    output_len: int


@dataclass
class BenchRequest:
    """One request, or (with `system` or `follow_ups`) a conversation: the first user
    message is `prompt`; each follow-up is sent when the previous turn has finished,
    with every earlier message and the server's actual reply before it."""

    prompt: str
    prompt_len: int | None  # tokens under the benchmark tokenizer; None when none is loaded
    output_len: int  # sent as max_tokens (with ignore_eos)
    system: str = ""  # a system (or tool-definition) message before the first turn
    follow_ups: tuple[FollowUp, ...] = ()
    arrival_s: float | None = None  # a replayed trace's own send time (else: the load's)

    @property
    def is_conversation(self) -> bool:
        return bool(self.system or self.follow_ups)

    @property
    def num_turns(self) -> int:
        return 1 + len(self.follow_ups)

    def first_messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": "user", "content": self.prompt}]


# ---- lengths ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthSpec:
    """A token length: fixed `128`, uniform `32:512` (inclusive), or `normal:128,32`."""

    kind: str  # fixed | uniform | normal
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str | int) -> LengthSpec:
        s = str(text).strip().replace(" ", "")
        try:
            if re.fullmatch(r"\d+", s):
                spec = cls("fixed", int(s))
            elif re.fullmatch(r"\d+:\d+", s):
                lo, hi = (int(x) for x in s.split(":"))
                if lo > hi:
                    raise ValueError
                spec = cls("uniform", lo, hi)
            elif s.startswith("normal:"):
                mean, std = (float(x) for x in s[len("normal:"):].split(","))
                spec = cls("normal", mean, std)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"invalid length {text!r}; use N, LO:HI (uniform) or "
                             f"normal:MEAN,STD") from None
        if spec.a < 1 and spec.kind != "normal" or spec.kind == "normal" and spec.b < 0:
            raise ValueError(f"invalid length {text!r}: lengths are at least 1 token")
        return spec

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [int(self.a)] * n
        if self.kind == "uniform":
            return [int(x) for x in rng.integers(int(self.a), int(self.b) + 1, size=n)]
        return [max(1, round(float(x))) for x in rng.normal(self.a, self.b, size=n)]

    def __str__(self) -> str:
        return {"fixed": f"{int(self.a)}", "uniform": f"{int(self.a)}:{int(self.b)}",
                "normal": f"normal:{self.a:g},{self.b:g}"}[self.kind]


# ---- exact-length random text ----------------------------------------------------------


def allowed_ids(tokenizer) -> np.ndarray:
    special = set(tokenizer.all_special_ids or [])
    vocab = len(tokenizer)
    return np.array([i for i in range(vocab) if i not in special], dtype=np.int64)


def token_count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def random_text(tokenizer, num_tokens: int, rng: np.random.Generator, allowed: np.ndarray,
                before: str = "", max_tries: int = 20) -> tuple[str, int]:
    """Text of `num_tokens` tokens when appended to `before` (decode random ids, re-encode,
    fix up, as vLLM's benchmark does). Returns (text, tokens it actually adds)."""
    base = token_count(tokenizer, before) if before else 0
    ids = [int(i) for i in rng.choice(allowed, size=num_tokens)]
    text = tokenizer.decode(ids)
    best = (text, token_count(tokenizer, before + text) - base)
    for _ in range(max_tries):
        ids = tokenizer.encode(before + text, add_special_tokens=False)[base:]
        if len(ids) == num_tokens:
            return text, num_tokens
        if len(ids) > num_tokens:
            ids = ids[:num_tokens]
        else:
            ids = ids + [int(i) for i in rng.choice(allowed, size=num_tokens - len(ids))]
        text = tokenizer.decode(ids)
        got = token_count(tokenizer, before + text) - base
        if abs(got - num_tokens) < abs(best[1] - num_tokens):
            best = (text, got)
        if got == num_tokens:
            return text, got
    return best


# ---- datasets --------------------------------------------------------------------------


@dataclass
class WorkloadSpec:
    dataset: str = "random"
    input_len: LengthSpec = LengthSpec("fixed", 128)
    output_len: LengthSpec = LengthSpec("fixed", 128)
    dataset_path: str | None = None
    num_prefixes: int = 1  # prefix dataset
    prefix_len: int = 1024
    sharegpt_max_input_len: int = 1024
    sharegpt_max_total_len: int = 2048
    output_len_from_dataset: bool = True  # sharegpt/jsonl: use the dataset's own lengths
    turns: int | None = None  # conversations: turns each (None: the dataset's default)
    trace_block_size: int = 512  # trace: tokens per hash id (Mooncake: 512)
    time_scale: float = 1.0  # trace: multiplies the timestamps (0.5: twice as fast)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dataset": self.dataset, "output_len": str(self.output_len)}
        if self.dataset in ("random", "prefix"):
            d["input_len"] = str(self.input_len)
        if self.dataset == "prefix":
            d.update(num_prefixes=self.num_prefixes, prefix_len=self.prefix_len)
        if self.dataset_path:
            d["dataset_path"] = self.dataset_path
        if self.dataset == "trace":
            d.update(trace_block_size=self.trace_block_size, time_scale=self.time_scale)
        if self.dataset in ("multiturn", "agentic") or (self.turns or 1) > 1:
            d["turns"] = self.turns or DEFAULT_TURNS.get(self.dataset, 1)
            d["input_len"] = str(self.input_len)
            if self.dataset == "agentic":
                d["prefix_len"] = self.prefix_len
        return d


def need_tokenizer(tokenizer, dataset: str) -> None:
    if tokenizer is None:
        raise ValueError(f"the {dataset} dataset needs a tokenizer for exact token counts; "
                         f"pass --tokenizer (a tokenmill model name, a .gguf or an HF dir)")


def turn_text(turn: Any) -> str:
    if isinstance(turn, str):
        return turn
    return str(turn.get("value") or turn.get("content") or "")
