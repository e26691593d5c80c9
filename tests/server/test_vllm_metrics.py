"""The metric names vLLM's Grafana dashboard (examples/online_serving/
prometheus_grafana/grafana.json) and llm-d's schedulers query, exported under
--metrics-prefix vllm with vLLM's labels, read back by prometheus_client's parser."""

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.engine.core.iteration_tokens import IterationTokens
from tokenmill.engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.engine.core.stats import EngineStats
from tokenmill.server.metrics import ServerMetrics

# (name as the dashboard queries it, Prometheus type)
DASHBOARD = [
    ("e2e_request_latency_seconds", "histogram"), ("prompt_tokens_total", "counter"),
    ("generation_tokens_total", "counter"), ("time_per_output_token_seconds", "histogram"),
    ("num_requests_running", "gauge"), ("num_requests_waiting", "gauge"),
    ("time_to_first_token_seconds", "histogram"), ("gpu_cache_usage_perc", "gauge"),
    ("kv_cache_usage_perc", "gauge"), ("request_prompt_tokens", "histogram"),
    ("request_generation_tokens", "histogram"), ("request_success_total", "counter"),
    ("request_queue_time_seconds", "histogram"), ("request_prefill_time_seconds", "histogram"),
    ("request_decode_time_seconds", "histogram"),
    ("request_max_num_generation_tokens", "histogram"),
    ("request_inference_time_seconds", "histogram"), ("iteration_tokens_total", "histogram"),
    ("request_params_n", "histogram"), ("request_params_max_tokens", "histogram"),
    ("inter_token_latency_seconds", "histogram"), ("cache_config_info", "gauge"),
]
CACHE = {"block_size": 16, "cache_dtype": "auto", "enable_prefix_caching": True,
         "num_gpu_blocks": 512, "kv_cache_memory_bytes": 1 << 20}


def _finished() -> RequestOutput:
    samples = [CompletionOutput(index=i, text="x" * n, token_ids=list(range(n)),
                                finish_reason="length") for i, n in enumerate((3, 7))]
    return RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1, 2, 3, 4, 5],
                         outputs=samples, finished=True,
                         metrics=RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5,
                                                first_token_time=11.0, finished_time=13.0))


def _scrape(metrics: ServerMetrics) -> dict:
    text = metrics.render().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_every_dashboard_metric_is_exported_with_vllm_labels():
    iteration = IterationTokens()
    for tokens in (1, 1, 40, 300):
        iteration.observe(tokens)
    stats = EngineStats(num_running=2, kv_cache_usage=0.25, iteration_tokens=iteration)
    metrics = ServerMetrics(lambda: stats, "org/model", prefix="vllm", cache_config=CACHE)
    metrics.observe_gap(0.05)
    metrics.observe_finished(_finished(), max_tokens=7)
    families = _scrape(metrics)
    for name, kind in DASHBOARD:
        family_name = name.removesuffix("_total") if kind == "counter" else name
        family = families.get(f"vllm:{family_name}")
        assert family is not None, name
        assert family.type == kind, name
        for sample in family.samples:
            assert sample.labels["model_name"] == "org/model", name
            assert sample.labels["engine"] == "0", name

    def value(family: str, sample: str, **labels: str) -> float:
        return next(s.value for s in families[f"vllm:{family}"].samples
                    if s.name == f"vllm:{sample}" and labels.items() <= s.labels.items())

    assert value("gpu_cache_usage_perc", "gpu_cache_usage_perc") == 0.25
    assert value("time_per_output_token_seconds", "time_per_output_token_seconds_sum") == 0.05
    assert value("request_decode_time_seconds", "request_decode_time_seconds_sum") == 2.0
    assert value("request_inference_time_seconds", "request_inference_time_seconds_sum") == 2.5
    assert value("request_prompt_tokens", "request_prompt_tokens_sum") == 5
    assert value("request_generation_tokens", "request_generation_tokens_sum") == 10
    assert value("request_max_num_generation_tokens",
                 "request_max_num_generation_tokens_sum") == 7
    assert value("request_params_n", "request_params_n_sum") == 2
    assert value("request_params_max_tokens", "request_params_max_tokens_sum") == 7
    assert value("iteration_tokens_total", "iteration_tokens_total_bucket", le="1.0") == 2
    assert value("iteration_tokens_total", "iteration_tokens_total_bucket", le="64.0") == 3
    assert value("iteration_tokens_total", "iteration_tokens_total_count") == 4
    assert value("iteration_tokens_total", "iteration_tokens_total_sum") == 342
    info = families["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == "512"


def test_engine_counts_tokens_per_step(tiny_model):
    from tokenmill import LLM, SamplingParams

    llm = LLM(tiny_model, max_model_len=256)
    llm.generate(["one two three four", "five six"], SamplingParams(max_tokens=3,
                                                                   temperature=0))
    stats = llm.engine.stats
    iteration = stats.iteration_tokens
    assert sum(iteration.counts) == stats.num_steps
    assert iteration.total == stats.num_prefill_tokens + stats.num_decode_tokens
