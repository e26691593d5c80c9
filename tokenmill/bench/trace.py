"""`--dataset trace`: replay a Mooncake-format request trace.

A trace is JSONL, one request a line: `timestamp` (ms since the trace began),
`input_length` and `output_length` (tokens) and `hash_ids`, one id per block of
`block_size` prompt tokens (Mooncake's traces use 512). Two requests that share the
leading ids share that prefix, so the prompts built here really share it: each id is
turned into one fixed run of random tokens, and a prompt is its ids' runs in order. A
row with more ids than its length fills uses the first ones; one with fewer gets its own
(unshared) tokens for the rest. Requests are sent at their timestamps, scaled by
`time_scale` (0.5 replays twice as fast).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.bench.prompts import BenchRequest, allowed_ids, need_tokenizer

MOONCAKE_BLOCK_SIZE = 512


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str) -> list[TraceRow]:
    """The trace's rows in file order; a clear error naming the line and field on bad input."""
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{lineno}: a trace row is a JSON object")  # noqa: TRY004
        for key in ("timestamp", "input_length", "output_length"):
            if not isinstance(obj.get(key), int | float) or obj[key] < 0:
                raise ValueError(f"{path}:{lineno}: '{key}' must be a non-negative number")
        ids = obj.get("hash_ids", [])
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError(f"{path}:{lineno}: 'hash_ids' must be a list of integers")
        if obj["input_length"] < 1 or obj["output_length"] < 1:
            raise ValueError(f"{path}:{lineno}: input_length and output_length are at "
                             f"least 1 token")
        rows.append(TraceRow(float(obj["timestamp"]), int(obj["input_length"]),
                             int(obj["output_length"]), tuple(ids)))
    if not rows:
        raise ValueError(f"{path} holds no trace rows")
    return rows


def trace_requests(rows: list[TraceRow], tokenizer, rng: np.random.Generator,
                   block_size: int = MOONCAKE_BLOCK_SIZE, time_scale: float = 1.0,
                   fixed_output_len: list[int] | None = None) -> list[BenchRequest]:
    """One request per row, `arrival_s` from the first row's timestamp, in time order.

    Prompts are built as token ids and decoded once: every block id maps to the same
    `block_size` random ids wherever it appears, so a shared id is a shared prefix in
    tokens (the server's prefix cache sees it), not only in text."""
    need_tokenizer(tokenizer, "trace")
    if block_size < 1:
        raise ValueError("--trace-block-size must be at least 1")
    if time_scale <= 0:
        raise ValueError("--time-scale must be positive")
    allowed = allowed_ids(tokenizer)
    blocks: dict[int, list[int]] = {}
    rows = sorted(rows, key=lambda r: r.timestamp_ms)
    t0 = rows[0].timestamp_ms
    out = []
    for k, row in enumerate(rows):
        ids: list[int] = []
        for b in range(math.ceil(row.input_length / block_size)):
            if b < len(row.hash_ids):
                h = row.hash_ids[b]
                if h not in blocks:
                    blocks[h] = [int(i) for i in rng.choice(allowed, size=block_size)]
                ids += blocks[h]
            else:
                ids += [int(i) for i in rng.choice(allowed, size=block_size)]
        ids = ids[:row.input_length]
        out_len = fixed_output_len[k] if fixed_output_len else row.output_length
        # the server re-tokenizes the text: its count (taken after the run) is the truth
        out.append(BenchRequest(tokenizer.decode(ids), None, out_len,
                                arrival_s=(row.timestamp_ms - t0) / 1000 * time_scale))
    return out


def synthetic_trace(num_requests: int, rng: np.random.Generator, mean_gap_ms: float = 100.0,
                    num_prefixes: int = 4, prefix_blocks: int = 2, block_size: int = 512,
                    max_extra_blocks: int = 2, output_length: int = 16) -> list[dict]:
    """A small trace in Mooncake's format, for tests and smoke runs (the public traces
    cannot be fetched everywhere): Poisson arrivals, `num_prefixes` shared prefixes of
    `prefix_blocks` blocks, each request a few blocks of its own after its prefix."""
    t, next_id, out = 0.0, num_prefixes * prefix_blocks, []
    for _ in range(num_requests):
        p = int(rng.integers(num_prefixes))
        own = int(rng.integers(1, max_extra_blocks + 1))
        ids = [p * prefix_blocks + j for j in range(prefix_blocks)]
        ids += list(range(next_id, next_id + own))
        next_id += own
        length = (prefix_blocks + own - 1) * block_size + int(rng.integers(1, block_size + 1))
        out.append({"timestamp": round(t), "input_length": length,
                    "output_length": output_length, "hash_ids": ids})
        t += float(rng.exponential(mean_gap_ms))
    return out


def trace_arrivals(requests: list[BenchRequest]) -> Iterator[float] | None:
    """The requests' own send times, from the first measured one (warmup rows before it are
    not waited for); None when the workload is not a trace."""
    if not requests or requests[0].arrival_s is None:
        return None
    t0 = requests[0].arrival_s
    n = len(requests)
    # --duration cycles the trace: each pass starts one trace-length later
    span = requests[-1].arrival_s - t0 + (requests[-1].arrival_s - t0) / max(1, n - 1)
    return (requests[i % n].arrival_s - t0 + (i // n) * span for i in itertools.count())
