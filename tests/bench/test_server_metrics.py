"""The server's own view: Prometheus scrapes turned into a `server` section, and the
client-vs-server comparison, against stubs speaking vLLM's names and llama-server's
`timings` (a real `tokenmill serve` is in test_reconcile_e2e.py)."""

import json

import pytest

from tests.bench.fakes import FakeServer, WordTokenizer
from tokenmill.bench import runner
from tokenmill.bench.client import ClientOptions
from tokenmill.bench.server_metrics import MetricsScraper, Snapshot, bucket_quantile, server_section
from tokenmill.bench.workload import BenchRequest
from tokenmill.cli import main as cli_main

VLLM_BEFORE = """\
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1
vllm:time_to_first_token_seconds_bucket{le="0.2",model_name="m"} 1
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 1
vllm:time_to_first_token_seconds_sum{model_name="m"} 0.05
vllm:time_to_first_token_seconds_count{model_name="m"} 1
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.1",model_name="m"} 0
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 0
vllm:time_per_output_token_seconds_sum{model_name="m"} 0
vllm:time_per_output_token_seconds_count{model_name="m"} 0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{model_name="m"} 10
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.0
"""
VLLM_AFTER = """\
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3
vllm:time_to_first_token_seconds_bucket{le="0.2",model_name="m"} 5
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 5
vllm:time_to_first_token_seconds_sum{model_name="m"} 0.65
vllm:time_to_first_token_seconds_count{model_name="m"} 5
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.1",model_name="m"} 4
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 4
vllm:time_per_output_token_seconds_sum{model_name="m"} 0.2
vllm:time_per_output_token_seconds_count{model_name="m"} 4
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{model_name="m"} 50
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
"""


def test_histogram_deltas_give_means_and_bucket_quantiles():
    """Older vLLM names (time_per_output_token, gpu_cache_usage) are understood too."""
    s = server_section(Snapshot.parse(VLLM_BEFORE, 10.0), Snapshot.parse(VLLM_AFTER, 12.0), [])
    assert s["available"] and s["scheme"] == "vllm"
    ttft = s["latency"]["ttft"]
    # 4 new observations summing to 0.6 s: 2 in (0, 0.1], 2 in (0.1, 0.2]
    assert ttft["count"] == 4 and ttft["mean_ms"] == pytest.approx(150.0)
    assert ttft["p50_ms"] == pytest.approx(100.0)  # rank 2 is the first bucket's top
    assert ttft["p90_ms"] == pytest.approx(180.0)  # rank 3.6: 80% into (0.1, 0.2]
    assert s["latency"]["itl"]["mean_ms"] == pytest.approx(50.0)
    assert s["counters"]["generation_tokens"] == 40
    assert s["gauges"]["running"]["max"] == 2
    assert s["gauges"]["kv_cache_usage"]["series"] == [[0.0, 0.0], [2.0, 0.25]]


def test_bucket_quantile_in_the_inf_bucket_is_the_last_finite_bound():
    assert bucket_quantile([(0.5, 1.0), (float("inf"), 10.0)], 0.99) == pytest.approx(500.0)
    assert bucket_quantile([], 0.5) is None


@pytest.mark.parametrize("text, scheme, keys", [
    (("# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 3\n"
     "# TYPE sglang:prompt_tokens counter\nsglang:prompt_tokens_total 7\n"),
     "sglang", ("running",)),
    (("# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total 100\n"
     "# TYPE llamacpp:tokens_predicted_seconds_total counter\n"
     "llamacpp:tokens_predicted_seconds_total 2.5\n"
     "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 1\n"),
     "llamacpp", ("running",)),
])
def test_other_schemes_are_recognized(text, scheme, keys):
    empty = Snapshot(0.0)
    s = server_section(empty, Snapshot.parse(text, 1.0), [])
    assert s["scheme"] == scheme
    for k in keys:
        assert k in s["gauges"]
    if scheme == "llamacpp":  # decode seconds per predicted token
        assert s["latency"]["tpot"]["mean_ms"] == pytest.approx(25.0)


@pytest.fixture(scope="module")
def vllm_fake():
    with FakeServer(vllm_metrics=True) as srv:
        yield srv


def run(srv, n=12, concurrency=4, scrape=True, **fake_opts):
    opts = ClientOptions(base_url=srv.base_url, model="fake",
                         extra_body={"fake": {"ttft_ms": 40, "gap_ms": 15, **fake_opts}})
    reqs = [BenchRequest(f"p{i} q r", 3, 8) for i in range(n)]
    scraper = MetricsScraper(srv.base_url, interval_s=0.1) if scrape else None
    plan = runner.BenchPlan(runner.HttpTarget(opts, WordTokenizer()), {"model": "fake"},
                            lambda i: reqs, scraper=scraper)
    return runner.run_once(plan, runner.LoadSpec(concurrency=concurrency))


def test_reconciliation_against_a_stub_with_vllm_metrics(vllm_fake):
    res = run(vllm_fake)
    srv = res["server"]
    assert srv["available"] and srv["scheme"] == "vllm" and srv["source"] == "metrics"
    assert srv["latency"]["ttft"]["count"] == 12  # this run only: deltas
    assert srv["counters"]["generation_tokens"] == 12 * 8
    assert srv["counters"]["prompt_tokens"] == 12 * 3
    rows = {r["what"]: r for r in srv["reconciliation"]}
    # the stub's own clock saw its schedule: 40 ms to the first chunk, 15 ms gaps
    assert srv["latency"]["ttft"]["mean_ms"] >= 40 and srv["latency"]["itl"]["mean_ms"] >= 15
    for what in ("TTFT mean (ms)", "E2E mean (ms)"):
        r = rows[what]  # the client's clock adds the transport (and this machine's load)
        assert r["client"] >= r["server"] * 0.99, r
        assert r["diff_pct"] == pytest.approx(100 * (r["client"] - r["server"]) / r["server"])
        gap = r["client"] - r["server"]  # ms
        assert r["warn"] == (abs(r["diff_pct"]) > 5 and abs(gap) > 10)
    assert rows["output tokens"]["diff_pct"] == 0 and not rows["output tokens"]["warn"]
    assert rows["requests finished"]["client"] == rows["requests finished"]["server"] == 12
    # sampled during the run: requests were running on the server
    assert srv["gauges"]["running"]["max"] >= 1
    assert len(srv["gauges"]["running"]["series"]) >= 3


def test_a_disagreement_over_five_percent_is_a_note(vllm_fake):
    res = run(vllm_fake, n=4, usage_delta=2)  # usage claims 2 more tokens than generated
    rows = {r["what"]: r for r in res["server"]["reconciliation"]}
    assert rows["output tokens"]["warn"] and rows["output tokens"]["diff_pct"] == 25.0
    assert any("disagree on output tokens by +25.0%" in n for n in res["notes"])


def test_llama_server_timings_stand_in_when_there_are_no_metrics():
    with FakeServer() as srv:  # /metrics is a 404
        res = run(srv, n=4, timings=True)
    s = res["server"]
    assert s["available"] and s["source"] == "timings" and s["scheme"] == "llamacpp"
    assert s["counters"]["generation_tokens"] == 4 * 8
    rows = {r["what"]: r for r in s["reconciliation"]}
    assert rows["TTFT mean (ms)"]["server"] >= 40
    assert rows["TPOT mean (ms)"]["server"] >= 15
    assert res["requests"][0]["server_timings"]["predicted_n"] == 8


def test_no_metrics_and_no_timings_says_why():
    with FakeServer() as srv:
        res = run(srv, n=2)
    assert res["server"]["available"] is False
    assert "404" in res["server"]["reason"]
    assert res["server"]["reconciliation"] == []


def test_command_writes_the_server_section_and_no_scrape_turns_it_off(vllm_fake, tmp_path,
                                                                      monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([f"prompt {i}" for i in range(4)]))
    common = ["bench", "--base-url", vllm_fake.base_url, "--dataset", "jsonl",
              "--dataset-path", str(prompts), "--output-len", "4", "--num-requests", "4",
              "--extra-body", '{"fake": {"ttft_ms": 5, "gap_ms": 2}}', "--no-progress"]
    assert cli_main([*common, "--output", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    assert "client vs server" in out and "vllm" in out
    res = json.loads((tmp_path / "a.json").read_text())
    assert res["server"]["latency"]["ttft"]["count"] == 4
    assert cli_main([*common, "--no-scrape", "--output", str(tmp_path / "b.json")]) == 0
    assert "server" not in json.loads((tmp_path / "b.json").read_text())


LLAMA_METRICS = """\
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 32
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 0.64
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 12
"""


class LlamaScraper:
    """llama-server's /metrics: token counters and times, no latency histograms."""

    def start(self) -> None:
        pass

    def stop(self, expected_requests=None) -> dict:
        return server_section(Snapshot(0.0), Snapshot.parse(LLAMA_METRICS, 1.0), [])


def test_llama_server_metrics_borrow_ttft_from_its_timings():
    with FakeServer() as srv:
        opts = ClientOptions(base_url=srv.base_url, model="fake",
                             extra_body={"fake": {"ttft_ms": 30, "gap_ms": 5, "timings": True}})
        reqs = [BenchRequest(f"p{i} q r", 3, 8) for i in range(4)]
        plan = runner.BenchPlan(runner.HttpTarget(opts, WordTokenizer()), {"model": "fake"},
                                lambda i: reqs, scraper=LlamaScraper())
        res = runner.run_once(plan, runner.LoadSpec(concurrency=2))
    lat = res["server"]["latency"]
    assert res["server"]["scheme"] == "llamacpp" and res["server"]["source"] == "metrics"
    assert lat["tpot"]["metric"] == "llamacpp:tokens_predicted_seconds_total"
    assert lat["tpot"]["mean_ms"] == pytest.approx(20.0)  # 0.64 s / 32 tokens
    assert lat["ttft"]["metric"] == "timings.prompt_ms" and lat["ttft"]["mean_ms"] >= 30
    assert "TTFT mean (ms)" in {r["what"] for r in res["server"]["reconciliation"]}


def test_a_latency_gap_warns_only_past_five_percent_and_ten_ms():
    from tokenmill.bench.reconcile import reconcile
    summary = {"ttft_ms": {"mean": 84.7}, "e2e_ms": {"mean": 2_200.0},
               "itl_ms": {"mean": 30.0}, "total_output_tokens": 51, "total_input_tokens": 9}
    server = {"latency": {"ttft": {"mean_ms": 80.2}, "e2e": {"mean_ms": 2_000.0},
                          "itl": {"mean_ms": 10.0}},
              "counters": {"generation_tokens": 48, "prompt_tokens": 9}}
    rows = {r["what"]: r for r in reconcile(summary, server)}
    assert not rows["TTFT mean (ms)"]["warn"]  # +5.6% but 4.5 ms: the transport
    assert rows["E2E mean (ms)"]["warn"]  # +10% and 200 ms
    assert rows["ITL mean (ms)"]["warn"]  # +200% and 20 ms
    assert rows["output tokens"]["warn"]  # a count: +6.2% warns with no floor
