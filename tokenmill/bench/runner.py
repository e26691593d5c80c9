"""Load orchestration: one run, a sweep over rates or concurrencies, and the bisection for
the highest request rate that still meets the SLOs (goodput as DistServe defines it).

A *target* sends requests and timestamps what comes back: `HttpTarget` (any
OpenAI-compatible server) or `offline.OfflineTarget` (the in-process engine). Both take
the same planned schedule: request i may be sent at its arrival time, and, with a
concurrency limit, only once a slot is free; `planned_time_s` is the later of the two.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from tokenmill.bench import metrics
from tokenmill.bench.client import (
    ClientOptions,
    OpenAIClient,
    RequestRecord,
    chat_prompt_len,
    count_chunk_tokens,
)
from tokenmill.bench.workload import BenchRequest, iter_arrivals


@dataclass(frozen=True)
class LoadSpec:
    concurrency: int | None = None  # None: unlimited
    request_rate: float = math.inf  # requests/s; inf: all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1 = Poisson
    duration_s: float | None = None  # stop sending after this long (cycling the prompts)

    def describe(self) -> str:
        parts = []
        if self.concurrency:
            parts.append(f"concurrency {self.concurrency}")
        if not math.isinf(self.request_rate):
            parts.append(f"rate {self.request_rate:g} req/s"
                         + (f" (burstiness {self.burstiness:g})" if self.burstiness != 1 else ""))
        return ", ".join(parts) or "all at once"


@dataclass
class RunOutcome:
    records: list[RequestRecord]
    duration_s: float
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the offline engine block
    notes: list[str] = field(default_factory=list)


OnDone = Callable[[RequestRecord], None]


class Target(Protocol):
    tokenizer: Any

    def run(self, requests: list[BenchRequest], load: LoadSpec, rng: np.random.Generator,
            on_done: OnDone, max_requests: int | None) -> RunOutcome: ...

    def warmup(self, requests: list[BenchRequest], concurrency: int | None) -> None: ...


# ---- the HTTP target -------------------------------------------------------------------


class HttpTarget:
    def __init__(self, options: ClientOptions, tokenizer) -> None:
        self.options = options
        self.tokenizer = tokenizer
        self.dropped_fields: list[str] = []

    def run(self, requests, load, rng, on_done, max_requests=None) -> RunOutcome:
        records, duration = asyncio.run(self._run(requests, load, rng, on_done, max_requests))
        for r in records:
            count_tokens(r, self.tokenizer)
            if self.options.endpoint == "chat":  # the template's tokens count as input too
                prompt = requests[r.request_id % len(requests)].prompt
                r.prompt_len = chat_prompt_len(self.tokenizer, prompt) or r.prompt_len
        notes = []
        if "ignore_eos" in self.dropped_fields:
            notes.append("the server rejected ignore_eos: output lengths were not forced, "
                         "requests may stop early at EOS")
        return RunOutcome(records, duration, {"dropped_fields": list(self.dropped_fields)},
                          notes)

    def warmup(self, requests, concurrency) -> None:
        if requests:
            self.run(requests, LoadSpec(concurrency=concurrency), np.random.default_rng(0),
                     lambda r: None)

    async def _run(self, requests, load, rng, on_done, max_requests):
        client = OpenAIClient(self.options)
        client.dropped_fields = self.dropped_fields
        try:
            with contextlib.suppress(Exception):  # open a connection, pay lazy imports now
                await client.http.get("/v1/models")
            return await dispatch(client.send, requests, load, rng, on_done, max_requests)
        finally:
            await client.aclose()


Send = Callable[[RequestRecord, str, float], Any]


async def dispatch(send: Send, requests: list[BenchRequest], load: LoadSpec,
                   rng: np.random.Generator, on_done: OnDone,
                   max_requests: int | None = None) -> tuple[list[RequestRecord], float]:
    """Send `requests` on the planned schedule; returns the records and the run duration.

    With `load.duration_s` the prompts cycle until that many seconds of sending (or
    `max_requests`); requests in flight at the end still finish and count."""
    limit = len(requests) if load.duration_s is None else (max_requests or math.inf)
    arrivals = iter_arrivals(load.request_rate, load.burstiness, rng)
    slots: asyncio.Queue[float] = asyncio.Queue()
    for _ in range(load.concurrency or 0):
        slots.put_nowait(0.0)
    records: list[RequestRecord] = []
    tasks = []
    t0 = time.perf_counter()

    def elapsed() -> float:
        return time.perf_counter() - t0

    async def one(record: RequestRecord, prompt: str) -> None:
        try:
            await send(record, prompt, t0)
        except Exception as e:  # noqa: BLE001 — a client bug must not hang the run
            record.fail("client_error", f"{type(e).__name__}: {e}", elapsed())
        finally:
            if load.concurrency:
                slots.put_nowait(elapsed())
            on_done(record)

    for i in itertools.count():
        if i >= limit:
            break
        arrival = next(arrivals)
        if load.duration_s is not None and arrival >= load.duration_s:
            break
        if arrival > elapsed():
            await asyncio.sleep(arrival - elapsed())
        freed = await slots.get() if load.concurrency else 0.0
        if load.duration_s is not None and elapsed() >= load.duration_s:
            break
        req = requests[i % len(requests)]
        record = RequestRecord(i, req.prompt_len, req.output_len,
                               planned_time_s=max(arrival, freed))
        records.append(record)
        tasks.append(asyncio.create_task(one(record, req.prompt)))
    await asyncio.gather(*tasks)
    return records, max((r.end_time_s for r in records), default=0.0)


def count_tokens(record: RequestRecord, tokenizer) -> None:
    """Client token counts, after the run so that tokenizing never delays a timestamp."""
    if tokenizer is None or not record.chunk_texts:
        count_chunk_tokens(record, tokenizer)
        return
    if len(record.chunk_tokens) == len(record.chunk_texts):
        record.client_output_tokens = len(
            tokenizer.encode(record.text, add_special_tokens=False))
        return
    try:  # one encode with offsets: each token goes to the chunk holding its last char
        enc = tokenizer(record.text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
    except (NotImplementedError, TypeError, ValueError, KeyError):
        count_chunk_tokens(record, tokenizer)
        return
    ends = list(itertools.accumulate(len(t) for t in record.chunk_texts))
    counts = [0] * len(ends)
    for start, end in offsets:
        pos = max(start, end - 1)
        counts[min(bisect.bisect_right(ends, pos), len(ends) - 1)] += 1
    record.chunk_tokens = counts
    record.client_output_tokens = len(offsets)


# ---- one run, sweeps, the SLO search ---------------------------------------------------


@dataclass
class BenchPlan:
    """Everything a run needs besides the load; built once by the command."""

    target: Target
    config: dict[str, Any]  # the result JSON's `config` (model, endpoint, backend, ...)
    make_requests: Callable[[int], list[BenchRequest]]  # run index -> warmup + measured
    warmup: int = 0
    request_cap: int | None = None  # with a duration: stop after this many requests too
    seed: int = 0
    slo: metrics.SLO | None = None
    cost_per_hour: float | None = None
    num_gpus: int = 1
    progress: Any = None  # report.ProgressFactory or None


def run_once(plan: BenchPlan, load: LoadSpec, run_index: int = 0) -> dict[str, Any]:
    """One measured run: warmup, then the load; returns the result dict."""
    requests = plan.make_requests(run_index)
    warm, measured = requests[:plan.warmup], requests[plan.warmup:]
    plan.target.warmup(warm, load.concurrency)
    rng = np.random.default_rng([plan.seed, run_index, 1])
    total = len(measured) if load.duration_s is None else plan.request_cap
    on_done_ctx = (plan.progress(load.describe(), total, load.duration_s)
                   if plan.progress is not None else contextlib.nullcontext(lambda r: None))
    with on_done_ctx as on_done:
        outcome = plan.target.run(measured, load, rng, on_done, plan.request_cap)
    summary = metrics.summarize(outcome.records, outcome.duration_s, plan.slo,
                                plan.cost_per_hour, plan.num_gpus)
    config = dict(plan.config, concurrency=load.concurrency,
                  request_rate=None if math.isinf(load.request_rate) else load.request_rate,
                  burstiness=load.burstiness, duration_s=load.duration_s,
                  num_requests=len(outcome.records), warmup=plan.warmup, seed=plan.seed)
    result: dict[str, Any] = {
        "config": config,
        "summary": summary,
        "notes": outcome.notes + summary_notes(summary),
        "requests": [metrics.record_dict(r) for r in outcome.records],
    }
    if "engine" in outcome.extra:
        result["engine"] = outcome.extra["engine"]
    if outcome.extra.get("dropped_fields"):
        result["config"]["dropped_request_fields"] = outcome.extra["dropped_fields"]
    return result


def summary_notes(s: dict[str, Any]) -> list[str]:
    notes = []
    if s["generator_lag_warning"]:
        notes.append(f"the load generator fell {s['generator_lag_s']:.3f} s behind its "
                     f"schedule (> 5% of the {s['duration_s']:.1f} s run): the client, not "
                     f"the server, may be the bottleneck")
    if s["num_short_outputs"]:
        notes.append(f"{s['num_short_outputs']} requests produced fewer tokens than max_tokens "
                     f"(the server may not honour ignore_eos)")
    check = s["token_count_check"]
    if check["output_mismatched"]:
        notes.append(f"output token counts differ between server usage and client "
                     f"tokenization in {check['output_mismatched']} of "
                     f"{check['output_compared']} requests ({check['output_server_total']} "
                     f"vs {check['output_client_total']} tokens); usage is used")
    if s["num_completed"] and not check["server_usage_available"]:
        notes.append("the server sent no usage: token counts come from the client's "
                     "tokenization")
    return notes


def run_sweep(plan: BenchPlan, base: LoadSpec, parameter: str,
              values: list[float]) -> dict[str, Any]:
    """One run per value of `parameter` (rate or concurrency), each on fresh prompts."""
    runs = []
    for i, v in enumerate(values):
        load = (replace(base, request_rate=float(v)) if parameter == "rate"
                else replace(base, concurrency=int(v)))
        runs.append(run_once(plan, load, run_index=i))
    return combine(plan, runs, {"sweep": {"parameter": parameter, "values": values}})


def search_max_rate(plan: BenchPlan, base: LoadSpec, target_attainment: float,
                    start_rate: float = 1.0, iterations: int = 6,
                    rel_tol: float = 0.05, on_probe: Callable[[dict], None] | None = None,
                    ) -> dict[str, Any]:
    """The highest request rate whose SLO attainment is at least `target_attainment` %:
    double until a rate fails (or halve until one passes), then bisect."""
    if plan.slo is None:
        raise ValueError("--max-rate-under-slo needs --slo (e.g. --slo ttft_ms=500 tpot_ms=50)")
    runs: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []

    def probe(rate: float) -> bool:
        result = run_once(plan, replace(base, request_rate=rate), run_index=len(runs))
        runs.append(result)
        s = result["summary"]
        ok = s["slo_attainment"] >= target_attainment
        probes.append({"request_rate": rate, "slo_attainment": s["slo_attainment"],
                       "goodput_req_s": s["goodput_req_s"], "passed": ok})
        if on_probe:
            on_probe(probes[-1])
        return ok

    lo, hi, rate = 0.0, math.inf, start_rate
    for _ in range(12):  # bracket
        if probe(rate):
            lo = rate
            if not math.isinf(hi):
                break
            rate *= 2
        else:
            hi = rate
            if lo > 0:
                break
            rate /= 2
    for _ in range(iterations):
        if lo == 0 or math.isinf(hi) or (hi - lo) / hi < rel_tol:
            break
        mid = (lo + hi) / 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    search = {"target_attainment": target_attainment, "slo": plan.slo.as_dict(),
              "max_rate_req_s": lo if lo > 0 else None,
              "first_failing_rate_req_s": None if math.isinf(hi) else hi,
              "probes": probes}
    best = next((i for i, p in enumerate(probes) if p["request_rate"] == lo), None)
    return combine(plan, runs, {"search": search}, best_index=best)


def combine(plan: BenchPlan, runs: list[dict[str, Any]], extra: dict[str, Any],
            best_index: int | None = None) -> dict[str, Any]:
    """A multi-run result: every run under `runs`; the top-level config/summary/requests
    are those of `best_index` (default: the run with the highest output throughput), so
    single-run readers (`tokenmill explain`) still find them."""
    if best_index is None:
        best_index = max(range(len(runs)),
                         key=lambda i: runs[i]["summary"]["output_throughput_tok_s"])
    best = runs[best_index]
    out = {"config": best["config"], "summary": best["summary"], "notes": best["notes"],
           "requests": best["requests"], **extra, "summary_run_index": best_index,
           "runs": runs}
    if "engine" in best:
        out["engine"] = best["engine"]
    return out
