"""Prometheus metrics, named as vLLM's with a `tokenmill:` prefix, or with
vLLM's own `vllm:` prefix and labels (model_name, engine) so vLLM's Grafana
dashboards and llm-d's endpoint picker read them unchanged (--metrics-prefix).

Engine gauges and cumulative counters are read from the worker's latest stats
snapshot at scrape time; per-request histograms are observed by the server as
requests stream and finish. Each app has its own registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                      2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM's 1-2-5 buckets for token counts and request parameters
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
_N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")
PREFIXES = ("tokenmill", "vllm")


def _base_labels(prefix: str, model_name: str) -> tuple[list[str], list[str]]:
    """Label names and values on every series: vLLM v1 adds the engine index."""
    if prefix == "vllm":
        return ["model_name", "engine"], [model_name, "0"]
    return ["model_name"], [model_name]


class _EngineStatsCollector(Collector):
    """Gauges and counters straight from the engine's stats snapshot."""

    def __init__(self, get_stats: Callable[[], Any], model_name: str,
                 prefix: str = "tokenmill") -> None:
        self.get_stats = get_stats
        self.model_name = model_name
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        st = self.get_stats()
        labels, values = _base_labels(self.prefix, self.model_name)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{self.prefix}:{name}", doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{self.prefix}:{name}", doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", st.num_running)
        if getattr(st, "max_lora", 0):  # vLLM's: the adapters in labels, the time as value
            g = GaugeMetricFamily(f"{self.prefix}:lora_requests_info", "Running stats on "
                                  "LoRA requests.", labels=["max_lora", "waiting_lora_adapters",
                                                            "running_lora_adapters"])
            g.add_metric([str(st.max_lora), st.waiting_lora_adapters,
                          st.running_lora_adapters], time.time())
            yield g
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", st.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.",
                    st.kv_cache_usage)
        # vLLM's older name of the same, which its Grafana dashboard still reads
        yield gauge("gpu_cache_usage_perc", "KV-cache usage (the name vLLM's dashboard "
                    "reads; the same as kv_cache_usage_perc).", st.kv_cache_usage)
        yield gauge("kv_cache_committed_bytes", "Bytes of KV-cache blocks ever used: what "
                    "the lazily touched pool adds to RSS so far.",
                    getattr(st, "kv_cache_committed_bytes", 0))
        yield gauge("kv_cache_pool_bytes", "Bytes of the whole KV-cache pool.",
                    getattr(st, "kv_cache_bytes", 0))
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      st.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      st.prefix_cache_hits)
        yield counter("num_preemptions", "Sequences preempted to free KV blocks.",
                      st.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens admitted.", st.prompt_tokens)
        yield counter("kv_transfer_received_tokens", "Prompt tokens whose KV was pulled "
                      "from a prefill instance (--kv-transfer-config).",
                      getattr(st, "kv_transfer_received_tokens", 0))
        yield counter("kv_transfer_fallback", "Requests prefilled here because their KV "
                      "transfer failed or timed out.", getattr(st, "kv_transfer_fallbacks", 0))
        yield counter("generation_tokens", "Tokens generated.", st.generation_tokens)
        iteration = getattr(st, "iteration_tokens", None)
        if iteration is not None:
            h = HistogramMetricFamily(f"{self.prefix}:iteration_tokens_total",
                                      "Tokens run per engine step.", labels=labels)
            h.add_metric(values, iteration.cumulative(), float(iteration.total))
            yield h
        # speculative decoding, named as vLLM's spec_decode_* metrics
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                      st.spec_proposed_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      st.spec_accepted_tokens)
        yield counter("spec_decode_num_drafts", "Sequence-steps that verified drafts.",
                      st.spec_verified_steps)
        yield gauge("spec_decode_draft_acceptance_rate", "Accepted / proposed draft tokens.",
                    st.spec_acceptance_rate)
        yield gauge("spec_decode_mean_accepted_length",
                    "Tokens emitted per speculating step (accepted drafts + 1).",
                    st.spec_mean_accepted_length)


class ServerMetrics:
    """core_pid: the engine core process, when it runs apart from this one; its
    RSS, CPU and open fds are exported as tokenmill_engine_core_process_*."""

    def __init__(self, get_stats: Callable[[], Any], model_name: str,
                 prefix: str = "tokenmill", core_pid: int | None = None,
                 cache_config: dict[str, Any] | None = None) -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {PREFIXES}, got {prefix!r}")
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.registry.register(_EngineStatsCollector(get_stats, model_name, prefix))
        ProcessCollector(registry=self.registry)  # this process: process_*
        if core_pid is not None:  # reads nothing (exports nothing) once the core is gone
            ProcessCollector(namespace="tokenmill_engine_core", pid=lambda: core_pid,
                             registry=self.registry)
        labels, self._values = _base_labels(prefix, model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(f"{prefix}:{name}", doc, labels, buckets=buckets,
                          registry=self.registry)
            h.labels(*self._values)  # exported (empty) before the first request
            return h

        self.request_success = Counter(
            f"{prefix}:request_success", "Finished requests, by finish reason.",
            [*labels, "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # present at 0 before the first request
            self.request_success.labels(*self._values, reason)
        self.ttft = histogram("time_to_first_token_seconds",
                              "Arrival to first generated token.", _LATENCY_BUCKETS_S)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between consecutive outputs of a request.", _ITL_BUCKETS_S)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Arrival to the last token.", _LATENCY_BUCKETS_S)
        self.queue = histogram("request_queue_time_seconds",
                               "Arrival to first scheduled.", _LATENCY_BUCKETS_S)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "First scheduled to first token.", _LATENCY_BUCKETS_S)
        # vLLM's older name of the inter-token latency, still on its dashboard
        self.tpot = histogram("time_per_output_token_seconds",
                              "Time between consecutive outputs of a request (the same as "
                              "inter_token_latency_seconds).", _ITL_BUCKETS_S)
        self.decode = histogram("request_decode_time_seconds",
                                "First token to the last.", _LATENCY_BUCKETS_S)
        self.inference = histogram("request_inference_time_seconds",
                                   "First scheduled to the last token.", _LATENCY_BUCKETS_S)
        self.prompt_tokens = histogram("request_prompt_tokens",
                                       "Prompt tokens of each finished request.", _TOKEN_BUCKETS)
        self.generation_tokens = histogram("request_generation_tokens",
                                           "Tokens generated for each finished request (all "
                                           "its n samples).", _TOKEN_BUCKETS)
        self.max_generation_tokens = histogram("request_max_num_generation_tokens",
                                               "Tokens of a request's longest sample.",
                                               _TOKEN_BUCKETS)
        self.params_n = histogram("request_params_n", "The n of each finished request.",
                                  _N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens",
                                           "The max_tokens of each finished request.",
                                           _TOKEN_BUCKETS)
        if cache_config is not None:  # an info metric: its labels say it, the value is 1
            info = Gauge(f"{prefix}:cache_config_info", "The KV-cache configuration.",
                         [*labels, *cache_config], registry=self.registry)
            info.labels(*self._values, *map(str, cache_config.values())).set(1)

    def observe_gap(self, gap_s: float) -> None:
        self.itl.labels(*self._values).observe(gap_s)
        self.tpot.labels(*self._values).observe(gap_s)

    def observe_aborted(self) -> None:
        self.request_success.labels(*self._values, "abort").inc()

    def observe_finished(self, output: Any, max_tokens: int | None = None) -> None:
        """Record one finished RequestOutput (once per request, as vLLM counts);
        `max_tokens`: the request's limit, if it set one."""
        reason = (output.outputs[0].finish_reason if output.outputs else None) or "abort"
        values = self._values
        self.request_success.labels(*values, reason).inc()
        lengths = [len(c.token_ids) for c in output.outputs]
        self.prompt_tokens.labels(*values).observe(len(output.prompt_token_ids or ()))
        self.generation_tokens.labels(*values).observe(sum(lengths))
        self.max_generation_tokens.labels(*values).observe(max(lengths, default=0))
        self.params_n.labels(*values).observe(max(1, len(output.outputs)))
        if max_tokens is not None:
            self.params_max_tokens.labels(*values).observe(max_tokens)
        m = output.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.labels(*values).observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.finished_time is not None:
            self.e2e.labels(*values).observe(max(0.0, m.finished_time - m.arrival_time))
            if m.first_token_time is not None:
                self.decode.labels(*values).observe(
                    max(0.0, m.finished_time - m.first_token_time))
            if m.first_scheduled_time is not None:
                self.inference.labels(*values).observe(
                    max(0.0, m.finished_time - m.first_scheduled_time))
        if m.first_scheduled_time is not None:
            self.queue.labels(*values).observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            if m.first_token_time is not None:
                self.prefill.labels(*values).observe(
                    max(0.0, m.first_token_time - m.first_scheduled_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)
