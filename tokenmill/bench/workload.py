"""What to send and when: datasets of prompts with exact token counts, and arrival processes.

Every dataset turns into a list of `BenchRequest` (prompt text, its length in tokens under
the benchmark tokenizer, and the output length to force with `max_tokens`). Everything is
drawn from one `numpy.random.Generator` seeded by `--seed`, so a run repeats exactly.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.conversations import seeded_conversations, sharegpt_conversations
from tokenmill.bench.prompts import (
    BenchRequest,
    FollowUp,
    LengthSpec,
    WorkloadSpec,
    allowed_ids,
    need_tokenizer,
    random_text,
    token_count,
    turn_text,
)

__all__ = ["DATASETS", "BenchRequest", "FollowUp", "LengthSpec", "WorkloadSpec",
           "arrival_times", "build_workload", "iter_arrivals", "load_prompts", "random_text"]

DATASETS = ("random", "sharegpt", "prefix", "jsonl", "multiturn", "agentic", "trace")


def build_workload(spec: WorkloadSpec, num_requests: int, tokenizer, seed: int,
                   run_index: int = 0) -> list[BenchRequest]:
    """`num_requests` requests of the dataset, in send order, reproducible from `seed`
    (for conversation datasets: that many conversations, see conversations.py).

    Each run of a sweep or search gets its own `run_index`, hence fresh prompts: new random
    draws, or for `jsonl` the next `num_requests` prompts of the file."""
    rng = np.random.default_rng([seed, run_index])
    if spec.dataset in ("multiturn", "agentic"):
        return seeded_conversations(spec, num_requests, tokenizer, rng)
    if spec.dataset == "sharegpt" and (spec.turns or 1) > 1:
        return sharegpt_conversations(spec, num_requests, tokenizer, rng)
    if spec.dataset == "random":
        return _random(spec, num_requests, tokenizer, rng)
    if spec.dataset == "prefix":
        return _prefix(spec, num_requests, tokenizer, rng)
    if spec.dataset == "sharegpt":
        return _sharegpt(spec, num_requests, tokenizer, rng)
    if spec.dataset == "trace":
        return _trace(spec, num_requests, tokenizer, rng)
    if spec.dataset == "jsonl":
        return _jsonl(spec, num_requests, tokenizer, rng, start=run_index * num_requests)
    raise ValueError(f"unknown dataset {spec.dataset!r}; choose from {', '.join(DATASETS)}")


def _random(spec, n, tokenizer, rng) -> list[BenchRequest]:
    need_tokenizer(tokenizer, "random")
    allowed = allowed_ids(tokenizer)
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
    need_tokenizer(tokenizer, "prefix")
    allowed = allowed_ids(tokenizer)
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
    need_tokenizer(tokenizer, "sharegpt")
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
        prompt, reply = turn_text(conv[0]), turn_text(conv[1])
        prompt_len = token_count(tokenizer, prompt)
        out_len = token_count(tokenizer, reply) if fixed_out is None else fixed_out[len(out)]
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
        prompt_len = token_count(tokenizer, p["prompt"]) if tokenizer is not None else None
        out.append(BenchRequest(p["prompt"], prompt_len, int(out_len or out_lens[i])))
    return out


def _trace(spec, n, tokenizer, rng) -> list[BenchRequest]:
    """The first `n` rows of a Mooncake trace, sent at their own timestamps."""
    from tokenmill.bench.trace import load_trace, trace_requests

    if not spec.dataset_path:
        raise ValueError("the trace dataset needs --trace-path FILE.jsonl (Mooncake format)")
    rows = load_trace(spec.dataset_path)[:n]
    fixed = None if spec.output_len_from_dataset else spec.output_len.sample(rng, len(rows))
    return trace_requests(rows, tokenizer, rng, spec.trace_block_size, spec.time_scale, fixed)


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
