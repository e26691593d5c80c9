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
    Prompt,
    RequestRecord,
    chat_prompt_len,
    count_chunk_tokens,
    render_as_text,
)
from tokenmill.bench.client_cost import (
    ClientCost,
    CostMeter,
    ProcessUsage,
    cost_note,
    summarize_cost,
)
from tokenmill.bench.reconcile import reconcile, reconcile_notes, timings_section
from tokenmill.bench.trace import trace_arrivals
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
    client_cost: ClientCost | None = None


OnDone = Callable[[RequestRecord], None]


class Target(Protocol):
    tokenizer: Any

    def run(self, requests: list[BenchRequest], load: LoadSpec, rng: np.random.Generator,
            on_done: OnDone, max_requests: int | None) -> RunOutcome: ...

    def warmup(self, requests: list[BenchRequest], concurrency: int | None) -> None: ...


# ---- the HTTP target -------------------------------------------------------------------


class HttpTarget:
    """Any OpenAI-compatible server, from one event loop or (`workers` > 1) from that many
    processes, each sending its shard of the schedule (see `workers.py`)."""

    def __init__(self, options: ClientOptions, tokenizer, workers: int = 1) -> None:
        self.options = options
        self.tokenizer = tokenizer
        self.workers = workers
        self.dropped_fields: list[str] = []

    def run(self, requests, load, rng, on_done, max_requests=None) -> RunOutcome:
        if self.workers > 1:
            from tokenmill.bench.workers import run_sharded

            done = run_sharded(self.options, requests, load, rng, on_done, max_requests,
                               self.workers, self.dropped_fields)
        else:
            done = asyncio.run(self._run(requests, load, rng, on_done, max_requests))
        records = done.records
        for r in records:
            count_tokens(r, self.tokenizer)
            count_prompt(r, self.tokenizer, chat=self.options.endpoint == "chat")
        notes = []
        if "ignore_eos" in self.dropped_fields:
            notes.append("the server rejected ignore_eos: output lengths were not forced, "
                         "requests may stop early at EOS")
        cost = summarize_cost(done.usages, done.duration_s, self.options.base_url,
                              extra_cpu_s=done.parent_cpu_s)
        return RunOutcome(records, done.duration_s,
                          {"dropped_fields": list(self.dropped_fields)}, notes, cost)

    def warmup(self, requests, concurrency) -> None:
        if requests:
            asyncio.run(self._run(requests, LoadSpec(concurrency=concurrency),
                                  np.random.default_rng(0), lambda r: None, None))

    async def _run(self, requests, load, rng, on_done, max_requests) -> Dispatched:
        client = OpenAIClient(self.options)
        client.dropped_fields = self.dropped_fields
        try:
            with contextlib.suppress(Exception):  # open a connection, pay lazy imports now
                await client.warm()
            return await dispatch(client.send, requests, load, rng, on_done, max_requests)
        finally:
            await client.aclose()


Send = Callable[[RequestRecord, Prompt, float], Any]


@dataclass(frozen=True)
class Shard:
    """This generator sends the jobs whose index is `index` mod `count`, on a clock whose
    zero is `start_time` (a `time.perf_counter()` value: CLOCK_MONOTONIC, shared by every
    process on the host, so the shards' timestamps need no translation)."""

    index: int = 0
    count: int = 1
    start_time: float | None = None  # None: now


@dataclass
class Dispatched:
    records: list[RequestRecord]
    duration_s: float
    usages: list[ProcessUsage]  # one per generator process
    parent_cpu_s: float = 0.0  # with workers: the parent's CPU while it collected


async def dispatch(send: Send, requests: list[BenchRequest], load: LoadSpec,
                   rng: np.random.Generator, on_done: OnDone,
                   max_requests: int | None = None, shard: Shard = Shard()) -> Dispatched:
    """Send `requests` on the planned schedule; returns the records and the run duration.

    With `load.duration_s` the prompts cycle until that many seconds of sending (or
    `max_requests`); requests in flight at the end still finish and count. A
    conversation holds its concurrency slot from its first turn to its last; each later
    turn is planned for the moment the previous one ended."""
    limit = len(requests) if load.duration_s is None else (max_requests or math.inf)
    arrivals = trace_arrivals(requests) or iter_arrivals(load.request_rate, load.burstiness,
                                                         rng)
    slots: asyncio.Queue[float] = asyncio.Queue()
    for _ in range(load.concurrency or 0):
        slots.put_nowait(0.0)
    records: list[RequestRecord] = []
    tasks = []
    meter = CostMeter()
    if shard.start_time is not None:
        await asyncio.sleep(max(0.0, shard.start_time - time.perf_counter()))
    t0 = time.perf_counter() if shard.start_time is None else shard.start_time
    meter.start()
    probe = asyncio.create_task(meter.probe())

    def elapsed() -> float:
        return time.perf_counter() - t0

    async def one(i: int, req: BenchRequest, planned: float) -> None:
        messages = req.first_messages() if req.is_conversation else None
        try:
            for k in range(req.num_turns):
                if k:
                    follow = req.follow_ups[k - 1]
                    messages += [{"role": "assistant", "content": records_of[i][-1].text},
                                 {"role": "user", "content": follow.user}]
                record = RequestRecord(
                    i, req.prompt_len if k == 0 else None,
                    req.output_len if k == 0 else req.follow_ups[k - 1].output_len,
                    planned_time_s=planned, prompt=req.prompt if messages is None
                    else list(messages), conversation_id=i if messages else None,
                    turn_index=k)
                records.append(record)
                records_of.setdefault(i, []).append(record)
                try:
                    await send(record, record.prompt, t0)
                except Exception as e:  # noqa: BLE001 — a client bug must not hang the run
                    record.fail("client_error", f"{type(e).__name__}: {e}", elapsed())
                on_done(record)
                if not record.ok:
                    break  # a conversation ends at its first failed turn
                planned = record.end_time_s
        finally:
            if load.concurrency:
                slots.put_nowait(elapsed())

    records_of: dict[int, list[RequestRecord]] = {}
    for i in itertools.count():
        if i >= limit:
            break
        arrival = next(arrivals)
        if load.duration_s is not None and arrival >= load.duration_s:
            break
        if i % shard.count != shard.index:
            continue  # another worker's job
        if arrival > elapsed():
            await asyncio.sleep(arrival - elapsed())
        freed = await slots.get() if load.concurrency else 0.0
        if load.duration_s is not None and elapsed() >= load.duration_s:
            break
        tasks.append(asyncio.create_task(one(i, requests[i % len(requests)],
                                             max(arrival, freed))))
    await asyncio.gather(*tasks)
    usage = meter.stop()
    await probe
    records.sort(key=lambda r: (r.request_id, r.turn_index))
    return Dispatched(records, max((r.end_time_s for r in records), default=0.0), [usage])


def count_prompt(record: RequestRecord, tokenizer, chat: bool) -> None:
    """Prompt tokens as the server sees them: chat requests through the template; later
    turns of a conversation (their prompt holds the server's reply) counted now."""
    if tokenizer is None or record.prompt is None:
        return
    if chat:
        record.prompt_len = chat_prompt_len(tokenizer, record.prompt) or record.prompt_len
    elif record.prompt_len is None:
        text = (record.prompt if isinstance(record.prompt, str)
                else render_as_text(record.prompt))
        record.prompt_len = len(tokenizer.encode(text, add_special_tokens=False))


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
    scraper: Any = None  # server_metrics.MetricsScraper, or None (--no-scrape, offline)
    power: bool = False  # read the host's power during each run (power.py)
    price_per_kwh: float | None = None  # $ per kWh for the energy's cost


def run_once(plan: BenchPlan, load: LoadSpec, run_index: int = 0) -> dict[str, Any]:
    """One measured run: warmup, then the load; returns the result dict."""
    requests = plan.make_requests(run_index)
    warm, measured = requests[:plan.warmup], requests[plan.warmup:]
    plan.target.warmup(warm, load.concurrency)
    rng = np.random.default_rng([plan.seed, run_index, 1])
    total = (sum(r.num_turns for r in measured) if load.duration_s is None
             else plan.request_cap)
    on_done_ctx = (plan.progress(load.describe(), total, load.duration_s)
                   if plan.progress is not None else contextlib.nullcontext(lambda r: None))
    if plan.scraper is not None:
        plan.scraper.start()
    meter = None
    if plan.power:
        from tokenmill.bench.power import PowerMeter

        meter = PowerMeter()
        meter.start()
    with on_done_ctx as on_done:
        outcome = plan.target.run(measured, load, rng, on_done, plan.request_cap)
    summary = metrics.summarize(outcome.records, outcome.duration_s, plan.slo,
                                plan.cost_per_hour, plan.num_gpus)
    if meter is not None:
        from tokenmill.bench.power import power_summary

        same = outcome.client_cost.same_host if outcome.client_cost is not None else True
        summary["power"] = power_summary(meter.stop(), summary["total_output_tokens"],
                                         plan.price_per_kwh, same)
    server = None
    if plan.scraper is not None:
        server = plan.scraper.stop(expected_requests=summary["num_completed"])
        if any(r.server_timings for r in outcome.records):
            timed = timings_section(outcome.records)
            if not server["available"]:
                server = timed
            else:  # llama-server's /metrics has no TTFT histogram: its timings do
                for key, st in timed["latency"].items():
                    server["latency"].setdefault(key, st)
        server["reconciliation"] = reconcile(summary, server) if server["available"] else []
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
    if outcome.client_cost is not None:
        result["client"] = outcome.client_cost.as_dict()
        note = cost_note(outcome.client_cost)
        if note:
            result["notes"].append(note)
    if server is not None:
        result["server"] = server
        result["notes"] += reconcile_notes(server)
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
    from tokenmill.bench.pareto import pareto_section

    par = pareto_section(runs, parameter, plan.num_gpus, plan.slo.tpot_ms if plan.slo else None)
    return combine(plan, runs, {"sweep": {"parameter": parameter, "values": values},
                                "pareto": par, "pareto_front": par["front"]})


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
    for key in ("engine", "client", "server"):
        if key in best:
            out[key] = best[key]
    return out
