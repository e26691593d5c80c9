"""The server's own view of a run: its Prometheus `/metrics`, scraped before, during and
after, and turned into the `server` section of the result.

Four naming schemes are understood (the first whose prefix appears wins): tokenmill's
`tokenmill:*`, vLLM's `vllm:*` (which tokenmill also speaks with `--metrics-prefix vllm`),
SGLang's `sglang:*` and llama-server's `llamacpp:*` (`--metrics`). Histograms give
means (Δsum / Δcount) and, where the buckets allow, quantiles; counters give deltas;
gauges give a time series (every `interval_s` while the run goes) and their peak.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# canonical key -> candidate sample names per scheme (older names after newer ones)
HISTOGRAMS: dict[str, dict[str, tuple[str, ...]]] = {
    "ttft": {"tokenmill": ("tokenmill:time_to_first_token_seconds",),
             "vllm": ("vllm:time_to_first_token_seconds",),
             "sglang": ("sglang:time_to_first_token_seconds",)},
    "itl": {"tokenmill": ("tokenmill:inter_token_latency_seconds",),
            "vllm": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
            "sglang": ("sglang:inter_token_latency_seconds",
                       "sglang:time_per_output_token_seconds")},
    "e2e": {"tokenmill": ("tokenmill:e2e_request_latency_seconds",),
            "vllm": ("vllm:e2e_request_latency_seconds",),
            "sglang": ("sglang:e2e_request_latency_seconds",)},
    "queue": {"tokenmill": ("tokenmill:request_queue_time_seconds",),
              "vllm": ("vllm:request_queue_time_seconds",),
              "sglang": ("sglang:queue_time_seconds",)},
}
COUNTERS: dict[str, dict[str, tuple[str, ...]]] = {
    "prompt_tokens": {"tokenmill": ("tokenmill:prompt_tokens_total",),
                      "vllm": ("vllm:prompt_tokens_total",),
                      "sglang": ("sglang:prompt_tokens_total",),
                      "llamacpp": ("llamacpp:prompt_tokens_total",)},
    "generation_tokens": {"tokenmill": ("tokenmill:generation_tokens_total",),
                          "vllm": ("vllm:generation_tokens_total",),
                          "sglang": ("sglang:generation_tokens_total",),
                          "llamacpp": ("llamacpp:tokens_predicted_total",)},
    "prefix_cache_queries": {"tokenmill": ("tokenmill:prefix_cache_queries_total",),
                             "vllm": ("vllm:prefix_cache_queries_total",
                                      "vllm:gpu_prefix_cache_queries_total")},
    "prefix_cache_hits": {"tokenmill": ("tokenmill:prefix_cache_hits_total",),
                          "vllm": ("vllm:prefix_cache_hits_total",
                                   "vllm:gpu_prefix_cache_hits_total")},
    "preemptions": {"tokenmill": ("tokenmill:num_preemptions_total",),
                    "vllm": ("vllm:num_preemptions_total",)},
    # llama-server has no latency histograms, only time totals
    "prompt_seconds": {"llamacpp": ("llamacpp:prompt_seconds_total",)},
    "predicted_seconds": {"llamacpp": ("llamacpp:tokens_predicted_seconds_total",)},
}
GAUGES: dict[str, dict[str, tuple[str, ...]]] = {
    "running": {"tokenmill": ("tokenmill:num_requests_running",),
                "vllm": ("vllm:num_requests_running",),
                "sglang": ("sglang:num_running_reqs",),
                "llamacpp": ("llamacpp:requests_processing",)},
    "waiting": {"tokenmill": ("tokenmill:num_requests_waiting",),
                "vllm": ("vllm:num_requests_waiting",),
                "sglang": ("sglang:num_queue_reqs",),
                "llamacpp": ("llamacpp:requests_deferred",)},
    "kv_cache_usage": {"tokenmill": ("tokenmill:kv_cache_usage_perc",),
                       "vllm": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
                       "sglang": ("sglang:token_usage",),
                       "llamacpp": ("llamacpp:kv_cache_usage_ratio",)},
    "cache_hit_rate": {"sglang": ("sglang:cache_hit_rate",)},
}
SCHEMES = ("tokenmill", "vllm", "sglang", "llamacpp")
QUANTILES = (50, 90, 99)


@dataclass
class Snapshot:
    """One scrape, flattened: sample name -> value summed over label sets (a server
    serving one model has one), and histogram buckets as name -> {upper bound: count}."""

    time_s: float  # time.perf_counter() of the scrape
    values: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, time_s: float) -> Snapshot:
        snap = cls(time_s)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_bucket") and "le" in s.labels:
                    base = s.name[: -len("_bucket")]
                    le = float(s.labels["le"])
                    b = snap.buckets.setdefault(base, {})
                    b[le] = b.get(le, 0.0) + s.value
                else:
                    snap.values[s.name] = snap.values.get(s.name, 0.0) + s.value
        return snap

    def scheme(self) -> str | None:
        names = list(self.values) + list(self.buckets)
        return next((p for p in SCHEMES if any(n.startswith(p + ":") for n in names)), None)


def _first(names: tuple[str, ...], present) -> str | None:
    return next((n for n in names if n in present), None)


def histogram_delta(before: Snapshot, after: Snapshot, base: str) -> dict[str, Any]:
    """Mean and bucket quantiles (ms) of what a histogram observed between two scrapes."""
    count = after.values.get(base + "_count", 0.0) - before.values.get(base + "_count", 0.0)
    total = after.values.get(base + "_sum", 0.0) - before.values.get(base + "_sum", 0.0)
    out: dict[str, Any] = {"metric": base, "count": round(count),
                           "mean_ms": 1e3 * total / count if count > 0 else None}
    b0, b1 = before.buckets.get(base, {}), after.buckets.get(base, {})
    cum = sorted((le, b1[le] - b0.get(le, 0.0)) for le in b1)
    for q in QUANTILES:
        out[f"p{q}_ms"] = bucket_quantile(cum, q / 100) if count > 0 else None
    return out


def bucket_quantile(cumulative: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket holding rank q·n (from 0
    at the first bucket); in the +Inf bucket, the last finite bound (a lower bound)."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower, below = 0.0, 0.0
    for le, c in cumulative:
        if c >= rank:
            if math.isinf(le):
                return 1e3 * lower
            inside = c - below
            frac = (rank - below) / inside if inside > 0 else 1.0
            return 1e3 * (lower + (le - lower) * frac)
        lower, below = le, c
    return 1e3 * lower


def server_section(before: Snapshot, after: Snapshot,
                   samples: list[Snapshot]) -> dict[str, Any]:
    """The result's `server` block from the scrapes around one run."""
    scheme = after.scheme() or before.scheme()
    out: dict[str, Any] = {"available": scheme is not None, "source": "metrics",
                           "scheme": scheme, "latency": {}, "counters": {}, "gauges": {}}
    if scheme is None:
        out["reason"] = "the /metrics page names no tokenmill:, vllm:, sglang: or llamacpp: metric"
        return out
    for key, schemes in HISTOGRAMS.items():
        name = _first(schemes.get(scheme, ()), after.buckets)
        if name:
            out["latency"][key] = histogram_delta(before, after, name)
    for key, schemes in COUNTERS.items():
        name = _first(schemes.get(scheme, ()), after.values)
        if name:
            out["counters"][key] = after.values[name] - before.values.get(name, 0.0)
    c = out["counters"]
    if c.get("prefix_cache_queries"):
        out["prefix_cache_hit_rate"] = c.get("prefix_cache_hits", 0.0) / c["prefix_cache_queries"]
    if c.get("generation_tokens") and "predicted_seconds" in c:  # llama-server: per token
        out["latency"]["tpot"] = {"metric": "llamacpp:tokens_predicted_seconds_total",
                                  "count": int(c["generation_tokens"]),
                                  "mean_ms": 1e3 * c["predicted_seconds"]
                                  / c["generation_tokens"]}
    t0 = before.time_s
    for key, schemes in GAUGES.items():
        series = [(s.time_s - t0, s.values[n]) for s in [before, *samples, after]
                  if (n := _first(schemes.get(scheme, ()), s.values))]
        if series:
            out["gauges"][key] = {"max": max(v for _, v in series),
                                  "mean": sum(v for _, v in series) / len(series),
                                  "series": [[round(t, 3), v] for t, v in series]}
    if "cache_hit_rate" in out["gauges"]:
        out["prefix_cache_hit_rate"] = out["gauges"]["cache_hit_rate"]["series"][-1][1]
    return out


class MetricsScraper:
    """Scrapes `base_url/metrics` from a thread: `start()` takes the first snapshot,
    then one every `interval_s` until `stop()` takes the last. Never raises: a server
    without metrics gives an unavailable section with the reason."""

    def __init__(self, base_url: str, api_key: str | None = None,
                 interval_s: float = 2.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = base_url.rstrip("/") + "/metrics"
        self.http = httpx.Client(timeout=5.0, headers=headers)
        self.interval_s = interval_s
        self.error: str | None = None
        self._before: Snapshot | None = None
        self._samples: list[Snapshot] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scrape(self) -> Snapshot | None:
        try:
            resp = self.http.get(self.url)
            if resp.status_code != 200:
                self.error = f"GET {self.url} returned {resp.status_code}"
                return None
            return Snapshot.parse(resp.text, time.perf_counter())
        except (httpx.HTTPError, ValueError) as e:
            self.error = f"GET {self.url} failed: {type(e).__name__}: {e}"
            return None

    def start(self) -> None:
        self.error = None
        self._before, self._samples = self.scrape(), []
        if self._before is None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bench-scrape")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            snap = self.scrape()
            if snap is not None:
                self._samples.append(snap)

    def stop(self, expected_requests: int | None = None) -> dict[str, Any]:
        """The `server` section; waits briefly for the server to record the last
        requests (it may observe a finish just after sending the final chunk)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self._before is None:
            return {"available": False, "source": "metrics", "reason": self.error}
        after = None
        for _ in range(10):
            after = self.scrape()
            if after is None or not expected_requests:
                break
            e2e = server_section(self._before, after, []).get("latency", {}).get("e2e")
            if e2e is None or e2e["count"] >= expected_requests:
                break
            time.sleep(0.1)
        if after is None:
            return {"available": False, "source": "metrics", "reason": self.error}
        return server_section(self._before, after, self._samples)

    def close(self) -> None:
        self.http.close()
