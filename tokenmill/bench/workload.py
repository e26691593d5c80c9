"""What to send and when: datasets of prompts with exact token counts, and arrival processes.

Every dataset turns into a list of `BenchRequest` (prompt text, its length in tokens under
the benchmark tokenizer, and the output length to force with `max_tokens`). Everything is
drawn from one `numpy.random.Generator` seeded by `--seed`, so a run repeats exactly.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATASETS = ("random", "sharegpt", "prefix", "jsonl")


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


def _allowed_ids(tokenizer) -> np.ndarray:
    special = set(tokenizer.all_special_ids or [])
    vocab = len(tokenizer)
    return np.array([i for i in range(vocab) if i not in special], dtype=np.int64)


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def random_text(tokenizer, num_tokens: int, rng: np.random.Generator, allowed: np.ndarray,
                before: str = "", max_tries: int = 20) -> tuple[str, int]:
    """Text of `num_tokens` tokens when appended to `before` (decode random ids, re-encode,
    fix up, as vLLM's benchmark does). Returns (text, tokens it actually adds)."""
    base = _count(tokenizer, before) if before else 0
    ids = [int(i) for i in rng.choice(allowed, size=num_tokens)]
    text = tokenizer.decode(ids)
    best = (text, _count(tokenizer, before + text) - base)
    for _ in range(max_tries):
        ids = tokenizer.encode(before + text, add_special_tokens=False)[base:]
        if len(ids) == num_tokens:
            return text, num_tokens
        if len(ids) > num_tokens:
            ids = ids[:num_tokens]
        else:
            ids = ids + [int(i) for i in rng.choice(allowed, size=num_tokens - len(ids))]
        text = tokenizer.decode(ids)
        got = _count(tokenizer, before + text) - base
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

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dataset": self.dataset, "output_len": str(self.output_len)}
        if self.dataset in ("random", "prefix"):
            d["input_len"] = str(self.input_len)
        if self.dataset == "prefix":
            d.update(num_prefixes=self.num_prefixes, prefix_len=self.prefix_len)
        if self.dataset_path:
            d["dataset_path"] = self.dataset_path
        return d


def build_workload(spec: WorkloadSpec, num_requests: int, tokenizer, seed: int,
                   run_index: int = 0) -> list[BenchRequest]:
    """`num_requests` requests of the dataset, in send order, reproducible from `seed`.

    Each run of a sweep or search gets its own `run_index`, hence fresh prompts: new random
    draws, or for `jsonl` the next `num_requests` prompts of the file."""
    rng = np.random.default_rng([seed, run_index])
    if spec.dataset == "random":
        return _random(spec, num_requests, tokenizer, rng)
    if spec.dataset == "prefix":
        return _prefix(spec, num_requests, tokenizer, rng)
    if spec.dataset == "sharegpt":
        return _sharegpt(spec, num_requests, tokenizer, rng)
    if spec.dataset == "jsonl":
        return _jsonl(spec, num_requests, tokenizer, rng, start=run_index * num_requests)
    raise ValueError(f"unknown dataset {spec.dataset!r}; choose from {', '.join(DATASETS)}")


def _need_tokenizer(tokenizer, dataset: str) -> None:
    if tokenizer is None:
        raise ValueError(f"the {dataset} dataset needs a tokenizer for exact token counts; "
                         f"pass --tokenizer (a tokenmill model name, a .gguf or an HF dir)")


def _random(spec, n, tokenizer, rng) -> list[BenchRequest]:
    _need_tokenizer(tokenizer, "random")
    allowed = _allowed_ids(tokenizer)
    in_lens = spec.input_len.sample(rng, n)
    out_lens = spec.output_len.sample(rng, n)
    out = []
    for in_len, out_len in zip(in_lens, out_lens):
        text, got = random_text(tokenizer, in_len, rng, allowed)
        out.append(BenchRequest(text, got, out_len))
    return out


def _prefix(spec, n, tokenizer, rng) -> list[BenchRequest]:
    """`num_prefixes` shared prefixes of `prefix_len` tokens, each request a distinct suffix
    of `input_len` tokens; request i uses prefix i mod num_prefixes."""
    _need_tokenizer(tokenizer, "prefix")
    allowed = _allowed_ids(tokenizer)
    prefixes = [random_text(tokenizer, spec.prefix_len, rng, allowed)
                for _ in range(spec.num_prefixes)]
    suffix_lens = spec.input_len.sample(rng, n)
    out_lens = spec.output_len.sample(rng, n)
    out = []
    for i, (suffix_len, out_len) in enumerate(zip(suffix_lens, out_lens)):
        prefix, prefix_got = prefixes[i % spec.num_prefixes]
        suffix, suffix_got = random_text(tokenizer, suffix_len, rng, allowed, before=prefix)
        out.append(BenchRequest(prefix + suffix, prefix_got + suffix_got, out_len))
    return out


def _sharegpt(spec, n, tokenizer, rng) -> list[BenchRequest]:
    """First human turn as the prompt, the reply's length as the output length; the usual
    filters (vLLM's): both ≥ 4 tokens, prompt ≤ max input, prompt + output ≤ max total."""
    _need_tokenizer(tokenizer, "sharegpt")
    if not spec.dataset_path:
        raise ValueError("the sharegpt dataset needs --dataset-path FILE.json")
    data = json.loads(Path(spec.dataset_path).read_text())
    convs = [c for d in data for c in [d.get("conversations") or d.get("conversation") or []]
             if len(c) >= 2]
    order = rng.permutation(len(convs))
    out: list[BenchRequest] = []
    fixed_out = spec.output_len.sample(rng, n) if not spec.output_len_from_dataset else None
    for idx in order:
        conv = convs[idx]
        prompt, reply = _turn_text(conv[0]), _turn_text(conv[1])
        prompt_len = _count(tokenizer, prompt)
        out_len = _count(tokenizer, reply) if fixed_out is None else fixed_out[len(out)]
        if prompt_len < 4 or (out_len < 4 and fixed_out is None):
            continue
        if prompt_len > spec.sharegpt_max_input_len or \
                prompt_len + out_len > spec.sharegpt_max_total_len:
            continue
        out.append(BenchRequest(prompt, prompt_len, out_len))
        if len(out) == n:
            return out
    if not out:
        raise ValueError(f"no conversation in {spec.dataset_path} passes the length filters")
    return _cycle(out, n)


def _turn_text(turn: Any) -> str:
    if isinstance(turn, str):
        return turn
    return str(turn.get("value") or turn.get("content") or "")


def load_prompts(path: str) -> list[dict[str, Any]]:
    """A JSON list or a JSONL file; each entry a string, or an object with `prompt` (or
    `text`) and optionally `output_len` / `max_tokens`."""
    raw = Path(path).read_text()
    stripped = raw.lstrip()
    if stripped.startswith("["):
        entries = json.loads(raw)
    else:
        entries = [json.loads(line) for line in raw.splitlines() if line.strip()]
    prompts = []
    for i, e in enumerate(entries):
        if isinstance(e, str):
            prompts.append({"prompt": e})
        elif isinstance(e, dict) and isinstance(e.get("prompt", e.get("text")), str):
            prompts.append({"prompt": e.get("prompt", e.get("text")),
                            "output_len": e.get("output_len") or e.get("max_tokens")})
        else:
            msg = f"{path}: entry {i} is neither a string nor an object with 'prompt'"
            raise ValueError(msg)  # noqa: TRY004 — bad file content, not a bad argument
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _jsonl(spec, n, tokenizer, rng, start: int = 0) -> list[BenchRequest]:
    """Your own prompts, in file order (so the first k are the same every run)."""
    if not spec.dataset_path:
        raise ValueError("the jsonl dataset needs --dataset-path FILE (.jsonl or a JSON list)")
    prompts = load_prompts(spec.dataset_path)
    out_lens = spec.output_len.sample(rng, n)
    out = []
    for i in range(n):
        p = prompts[(start + i) % len(prompts)]
        out_len = p.get("output_len") if spec.output_len_from_dataset else None
        prompt_len = _count(tokenizer, p["prompt"]) if tokenizer is not None else None
        out.append(BenchRequest(p["prompt"], prompt_len, int(out_len or out_lens[i])))
    return out


def _cycle(items: list, n: int) -> list:
    return [items[i % len(items)] for i in range(n)]


# ---- arrival process -------------------------------------------------------------------


def iter_arrivals(request_rate: float, burstiness: float, rng: np.random.Generator,
                  block: int = 256) -> Iterator[float]:
    """Planned send times in seconds from the start, without end; the first is 0.

    Gaps are gamma distributed with shape = burstiness and mean 1/rate, so the squared
    coefficient of variation of the gaps is 1/burstiness (1 = Poisson arrivals; < 1
    burstier, > 1 more regular). An infinite rate sends everything at once."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    if math.isinf(request_rate):
        return itertools.repeat(0.0)
    theta = 1.0 / (request_rate * burstiness)

    def times() -> Iterator[float]:
        t = 0.0
        yield t
        while True:
            for gap in rng.gamma(shape=burstiness, scale=theta, size=block):
                t += float(gap)
                yield t

    return times()


def arrival_times(num_requests: int, request_rate: float, burstiness: float,
                  rng: np.random.Generator) -> np.ndarray:
    """The first `num_requests` planned send times of `iter_arrivals`."""
    it = iter_arrivals(request_rate, burstiness, rng)
    return np.fromiter(itertools.islice(it, num_requests), dtype=float, count=num_requests)
