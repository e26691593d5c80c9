"""The benchmark's numbers, defined exactly (the same words are in `--help` and docs/bench.md).

All inputs are `RequestRecord`s with times in seconds from the run's start; latencies
come out in milliseconds, throughputs per second of the run's duration (first planned
send to the last response's end).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from tokenmill.bench.client import CONNECTION_FAILURES, RequestRecord

METRIC_DEFINITIONS = """\
Metric definitions (times from the client's clock; a content chunk is one that carries
generated text, so a role-only first chunk never counts):
  TTFT      arrival of the first content chunk - send time.
  E2E       arrival of the last content chunk - send time.
  TPOT      per request: (E2E - TTFT) / (output tokens - 1); undefined for 1-token outputs.
  ITL       every gap between consecutive content chunks, pooled over all requests and
            token-weighted: a gap g before a chunk carrying k tokens counts as k samples of
            g/k (so a request's mean ITL equals its TPOT when its first chunk has 1 token).
            Tokens per chunk come from per-chunk server usage when sent, else from the
            client's tokenization of the growing text; their histogram is reported.
  tokens    output tokens from the server's usage (stream_options.include_usage), input
            tokens likewise; the client's own count is reported beside it, with any mismatch.
  stats     mean, std (population), p50, p90, p95, p99 (linear interpolation), max.
  duration  first planned send to the end of the last response.
  req/s     completed requests / duration; output tok/s = output tokens of completed
            requests / duration; total tok/s adds their input tokens; peak output tok/s =
            the most output tokens arriving in any 1 s bucket of the run; mean in-flight =
            sum over all requests of (end - send) / duration.
  failures  every request that did not finish cleanly, by kind (connect, disconnected,
            timeout, http_NNN, incomplete, no_content, ...); failures count in attainment
            and in-flight time, never silently dropped.
  goodput   requests/s that completed AND met every SLO given with --slo (<= is a pass;
            TPOT passes for 1-token outputs); attainment = those / all requests, in %.
  cost      $ per 1M tokens = cost_per_hour x num_gpus / (tok/s x 3600) x 1e6, for output
            tokens and for total tokens.
  lag       the load generator's own delay: actual send - planned send (planned = the
            arrival time, or when a concurrency slot freed, whichever is later); a warning
            is printed when the worst lag exceeds 5% of the run."""

SERVER_CLIENT_DEFINITIONS = """\
Server side (the `server` section): the target's /metrics, scraped before and after each
run and every --scrape-interval seconds during it (--no-scrape: off):
  scheme    the first of tokenmill:, vllm:, sglang:, llamacpp: that the page names.
  latency   per histogram (TTFT, ITL, E2E, queue time): count and mean = delta sum / delta
            count over the run; p50/p90/p99 linear inside the buckets (Prometheus'
            histogram_quantile; in the +Inf bucket, its lower bound). The server's clock
            starts when it received the request. llama-server: TPOT = delta
            tokens_predicted_seconds / delta tokens_predicted; without /metrics, its
            per-response `timings` (TTFT = mean prompt_ms, TPOT = mean
            predicted_per_token_ms).
  counters  deltas over the run: prompt and generation tokens, prefix-cache queries and
            hits (hit rate = hits / queries), preemptions.
  gauges    requests running and waiting, KV-cache usage (0..1): each scrape as
            [seconds since the first scrape, value], with mean and max.
  diff      100 x (client - server) / server for the TTFT, ITL, TPOT and E2E means,
            output and input tokens, finished requests; |diff| > 5% is a warning (for a
            latency mean only when the gap is also over 10 ms: the transport). The
            client's ITL there is itl_pooled_ms = sum(last - first content chunk) /
            sum(output tokens - 1) over completed requests, which counts the tokens a
            stream never showed as text (special tokens under ignore_eos) as the server's
            histogram does.
Client side (the `client` section):
  cpu_seconds  user + system CPU of every load-generator process, all threads (the
            scraper's included), from the first send to the last response.
  cpu_share    cpu_seconds / (wall_s x num_cpus): 0..1 of this machine.
  loop_lag_ms  how late a 5 ms sleep in each generator's event loop woke: mean, p50, p99,
            max.
  warning   the target is on this host (a loopback address, or this host's own name or
            address) and cpu_share > 0.10: the client competes with the server for cores.
  workers   --workers N: job i (a request, or a whole conversation) goes to process
            i mod N with its share of --concurrency; every process follows the same
            seeded schedule and timestamps on one monotonic clock; records are merged."""

PERCENTILES = (50, 90, 95, 99)
LAG_WARN_FRACTION = 0.05


def latency_stats(values: list[float] | np.ndarray, weights: list[int] | None = None,
                  scale: float = 1000.0) -> dict[str, float | None]:
    """mean/std/p50/p90/p95/p99/max of `values` (seconds) in ms; `weights` repeat samples."""
    arr = np.asarray(values, dtype=float)
    if weights is not None:
        arr = np.repeat(arr, np.asarray(weights, dtype=int))
    keys = ["mean", "std", *(f"p{p}" for p in PERCENTILES), "max"]
    if arr.size == 0:
        return {**dict.fromkeys(keys), "count": 0}
    arr = arr * scale
    out: dict[str, float | None] = {"mean": float(arr.mean()), "std": float(arr.std())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    out["max"] = float(arr.max())
    out["count"] = int(arr.size)
    return out


# ---- per request -----------------------------------------------------------------------


def ttft_s(r: RequestRecord) -> float | None:
    return r.chunk_times_s[0] - r.send_time_s if r.chunk_times_s else None


def e2e_s(r: RequestRecord) -> float | None:
    return r.chunk_times_s[-1] - r.send_time_s if r.chunk_times_s else None


def output_tokens(r: RequestRecord) -> int:
    if r.usage_completion_tokens is not None:
        return r.usage_completion_tokens
    if r.client_output_tokens is not None:
        return r.client_output_tokens
    return sum(r.chunk_tokens) if r.chunk_tokens else len(r.chunk_times_s)


def input_tokens(r: RequestRecord) -> int:
    if r.usage_prompt_tokens is not None:
        return r.usage_prompt_tokens
    return r.prompt_len or 0


def tpot_s(r: RequestRecord) -> float | None:
    n = output_tokens(r)
    ttft, e2e = ttft_s(r), e2e_s(r)
    if ttft is None or e2e is None or n < 2:
        return None
    return (e2e - ttft) / (n - 1)


def itl_samples(r: RequestRecord) -> tuple[list[float], list[int]]:
    """(per-token gap g/k, weight k) for every content chunk after the first."""
    values, weights = [], []
    t = r.chunk_times_s
    for i in range(1, len(t)):
        k = max(1, r.chunk_tokens[i] if i < len(r.chunk_tokens) else 1)
        values.append((t[i] - t[i - 1]) / k)
        weights.append(k)
    return values, weights


# ---- SLOs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, items: list[str] | None) -> SLO | None:
        """['ttft_ms=500', 'tpot_ms=50'] -> SLO; None when no item is given."""
        if not items:
            return None
        values: dict[str, float] = {}
        for item in items:
            for part in item.replace(",", " ").split():
                key, sep, value = part.partition("=")
                if not sep or key not in ("ttft_ms", "tpot_ms", "e2e_ms"):
                    raise ValueError(f"invalid SLO {part!r}; use ttft_ms=N tpot_ms=N e2e_ms=N")
                try:
                    values[key] = float(value)
                except ValueError:
                    raise ValueError(f"invalid SLO value in {part!r}") from None
        return cls(**values)

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        checks = (("ttft", self.ttft_ms, ttft_s(r)), ("tpot", self.tpot_ms, tpot_s(r)),
                  ("e2e", self.e2e_ms, e2e_s(r)))
        for name, limit_ms, value_s in checks:
            if limit_ms is None:
                continue
            if value_s is None:
                if name == "tpot":  # 1-token output: there is no time per output token
                    continue
                return False
            if value_s * 1000.0 > limit_ms + 1e-9:  # float noise must not fail an edge
                return False
        return True

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms}


def cost_per_1m_tokens(cost_per_hour: float | None, num_gpus: int,
                       tok_s: float) -> float | None:
    if cost_per_hour is None or tok_s <= 0:
        return None
    return cost_per_hour * num_gpus / (tok_s * 3600.0) * 1e6


# ---- a whole run -----------------------------------------------------------------------


def run_duration_s(records: list[RequestRecord]) -> float:
    if not records:
        return 0.0
    start = min(r.planned_time_s for r in records)
    return max(r.end_time_s for r in records) - start


def peak_output_tok_s(records: list[RequestRecord], start_s: float = 0.0) -> float:
    buckets: Counter[int] = Counter()
    for r in records:
        for t, k in zip(r.chunk_times_s, r.chunk_tokens or [1] * len(r.chunk_times_s)):
            buckets[math.floor(t - start_s)] += k
    return float(max(buckets.values())) if buckets else 0.0


def summarize(records: list[RequestRecord], duration_s: float | None = None,
              slo: SLO | None = None, cost_per_hour: float | None = None,
              num_gpus: int = 1) -> dict:
    """The `summary` block of the result JSON."""
    if duration_s is None:
        duration_s = run_duration_s(records)
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    dur = max(duration_s, 1e-9)
    out_toks = [output_tokens(r) for r in done]
    in_toks = [input_tokens(r) for r in done]
    itl_v: list[float] = []
    itl_w: list[int] = []
    gaps: list[float] = []
    for r in done:
        v, w = itl_samples(r)
        itl_v += v
        itl_w += w
        gaps += list(np.diff(r.chunk_times_s))
    chunk_sizes = Counter(k for r in done for k in r.chunk_tokens)
    num_chunks = sum(chunk_sizes.values())
    out_tok_s = sum(out_toks) / dur
    total_tok_s = (sum(out_toks) + sum(in_toks)) / dur
    start = min((r.planned_time_s for r in records), default=0.0)
    lags = [max(0.0, r.send_time_s - r.planned_time_s) for r in records]
    summary = {
        "duration_s": duration_s,
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(failed),
        "failures": dict(Counter(r.error_kind for r in failed)),
        "request_throughput": len(done) / dur,
        "output_throughput_tok_s": out_tok_s,
        "total_throughput_tok_s": total_tok_s,
        "peak_output_throughput_tok_s": peak_output_tok_s(done, start),
        "mean_in_flight": sum(max(0.0, r.end_time_s - r.send_time_s) for r in records) / dur,
        "total_input_tokens": sum(in_toks),
        "total_output_tokens": sum(out_toks),
        "mean_input_tokens": float(np.mean(in_toks)) if in_toks else 0.0,
        "mean_output_tokens": float(np.mean(out_toks)) if out_toks else 0.0,
        "ttft_ms": latency_stats([ttft_s(r) for r in done]),
        "tpot_ms": latency_stats([t for r in done if (t := tpot_s(r)) is not None]),
        "itl_ms": latency_stats(itl_v, itl_w),
        "e2e_ms": latency_stats([e2e_s(r) for r in done]),
        "chunk_gap_ms": latency_stats(gaps),
        "itl_pooled_ms": itl_pooled_ms(done),
        "chunk_tokens": {"histogram": {str(k): v for k, v in sorted(chunk_sizes.items())},
                         "mean": (sum(k * v for k, v in chunk_sizes.items()) / num_chunks
                                  if num_chunks else None)},
        "token_count_check": token_count_check(done),
        "num_short_outputs": sum(1 for r in done if output_tokens(r) < r.max_tokens),
        "goodput_req_s": None,
        "slo_attainment": None,
        "slo": slo.as_dict() if slo else None,
        "cost_per_1m_output_tokens": cost_per_1m_tokens(cost_per_hour, num_gpus, out_tok_s),
        "cost_per_1m_total_tokens": cost_per_1m_tokens(cost_per_hour, num_gpus, total_tok_s),
        "generator_lag_s": max(lags, default=0.0),
        "generator_lag_mean_s": float(np.mean(lags)) if lags else 0.0,
        "generator_lag_p99_s": float(np.percentile(lags, 99)) if lags else 0.0,
        "generator_lag_warning": bool(lags) and max(lags) > LAG_WARN_FRACTION * dur,
        "connection_failures": sum(1 for r in failed if r.error_kind in CONNECTION_FAILURES),
    }
    if slo is not None:
        good = sum(1 for r in records if slo.met(r))
        summary["goodput_req_s"] = good / dur
        summary["slo_attainment"] = 100.0 * good / len(records) if records else 0.0
    return summary


def itl_pooled_ms(done: list[RequestRecord]) -> float | None:
    """Σ (last − first content chunk) / Σ (output tokens − 1), with the server's token
    counts: what a server's per-output ITL histogram averages, including tokens whose
    text the stream never showed (special tokens under ignore_eos)."""
    pairs = [(e2e_s(r) - ttft_s(r), output_tokens(r) - 1) for r in done
             if r.chunk_times_s and output_tokens(r) >= 2]
    tokens = sum(n for _, n in pairs)
    return 1e3 * sum(t for t, _ in pairs) / tokens if tokens else None


def token_count_check(done: list[RequestRecord]) -> dict:
    """Server usage vs the client's tokenization, for output and input tokens."""
    out_pairs = [(r.usage_completion_tokens, r.client_output_tokens) for r in done
                 if r.usage_completion_tokens is not None and r.client_output_tokens is not None]
    in_pairs = [(r.usage_prompt_tokens, r.prompt_len) for r in done
                if r.usage_prompt_tokens is not None and r.prompt_len is not None]
    return {
        "server_usage_available": sum(1 for r in done if r.usage_completion_tokens is not None),
        "output_compared": len(out_pairs),
        "output_mismatched": sum(1 for s, c in out_pairs if s != c),
        "output_server_total": sum(s for s, _ in out_pairs),
        "output_client_total": sum(c for _, c in out_pairs),
        "input_compared": len(in_pairs),
        "input_mismatched": sum(1 for s, c in in_pairs if s != c),
        "input_server_total": sum(s for s, _ in in_pairs),
        "input_client_total": sum(c for _, c in in_pairs),
    }


def record_dict(r: RequestRecord) -> dict:
    """One per-request entry of the result JSON (times in seconds from the run's start)."""
    rnd = 6
    return {
        "id": r.request_id,
        "planned_time_s": round(r.planned_time_s, rnd),
        "send_time_s": round(r.send_time_s, rnd),
        "end_time_s": round(r.end_time_s, rnd),
        "ttft_s": None if (t := ttft_s(r)) is None else round(t, rnd),
        "e2e_s": None if (t := e2e_s(r)) is None else round(t, rnd),
        "tpot_s": None if (t := tpot_s(r)) is None else round(t, rnd),
        "first_chunk_time_s": None if r.first_chunk_time_s is None
        else round(r.first_chunk_time_s, rnd),
        "chunk_times_s": [round(t, rnd) for t in r.chunk_times_s],
        "chunk_tokens": list(r.chunk_tokens),
        "input_tokens_server": r.usage_prompt_tokens,
        "input_tokens_client": r.prompt_len,
        "output_tokens_server": r.usage_completion_tokens,
        "output_tokens_client": r.client_output_tokens,
        "max_tokens": r.max_tokens,
        "finish_reason": r.finish_reason,
        "error_kind": r.error_kind,
        "error": r.error,
        "conversation_id": r.conversation_id,
        "turn": r.turn_index,
        "server_timings": r.server_timings,
    }
