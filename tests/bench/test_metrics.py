"""Metric definitions on hand-built traces with hand-computed answers."""

import pytest

from tokenmill.bench import metrics
from tokenmill.bench.client import RequestRecord
from tokenmill.bench.metrics import SLO


def chat_record() -> RequestRecord:
    """Role-only first chunk at 1.05 s, then 1 + 2 + 1 tokens at 1.2, 1.3, 1.5 s."""
    r = RequestRecord(0, prompt_len=10, max_tokens=4, planned_time_s=1.0, send_time_s=1.0,
                      end_time_s=1.55, first_chunk_time_s=1.05)
    r.chunk_times_s = [1.2, 1.3, 1.5]
    r.chunk_tokens = [1, 2, 1]
    r.chunk_texts = ["a", " b c", " d"]
    r.usage_prompt_tokens, r.usage_completion_tokens = 10, 4
    r.client_output_tokens = 3  # the client's tokenization disagrees with usage
    r.finish_reason = "length"
    return r


def one_token_record() -> RequestRecord:
    r = RequestRecord(1, prompt_len=6, max_tokens=1, planned_time_s=0.0, send_time_s=0.0,
                      end_time_s=0.35)
    r.chunk_times_s, r.chunk_tokens, r.chunk_texts = [0.3], [1], ["x"]
    r.usage_prompt_tokens, r.usage_completion_tokens, r.client_output_tokens = 6, 1, 1
    return r


def failed_record() -> RequestRecord:
    r = RequestRecord(2, prompt_len=5, max_tokens=4, planned_time_s=0.4, send_time_s=0.5)
    r.fail("connect", "refused", 0.6)
    return r


def test_ttft_ignores_role_only_chunk_and_tpot_uses_usage_tokens():
    r = chat_record()
    assert metrics.ttft_s(r) == pytest.approx(0.2)
    assert metrics.e2e_s(r) == pytest.approx(0.5)
    assert metrics.tpot_s(r) == pytest.approx(0.3 / 3)


def test_itl_is_token_weighted_per_chunk():
    values, weights = metrics.itl_samples(chat_record())
    assert values == pytest.approx([0.05, 0.2])  # 0.1 s for 2 tokens, then 0.2 s for 1
    assert weights == [2, 1]
    stats = metrics.latency_stats(values, weights)
    assert stats["count"] == 3
    assert stats["mean"] == pytest.approx(100.0)
    assert stats["p50"] == pytest.approx(50.0)
    assert stats["max"] == pytest.approx(200.0)


def test_one_token_output_has_no_tpot_and_no_itl():
    r = one_token_record()
    assert metrics.ttft_s(r) == pytest.approx(0.3) == metrics.e2e_s(r)
    assert metrics.tpot_s(r) is None
    assert metrics.itl_samples(r) == ([], [])


def test_output_tokens_fall_back_to_client_count_then_chunks():
    r = chat_record()
    r.usage_completion_tokens = None
    assert metrics.output_tokens(r) == 3
    r.client_output_tokens = None
    assert metrics.output_tokens(r) == 4  # sum of chunk tokens


def test_summary_counts_failures_and_computes_throughputs():
    records = [chat_record(), one_token_record(), failed_record()]
    s = metrics.summarize(records, duration_s=2.0, cost_per_hour=3.6, num_gpus=2)
    assert (s["num_completed"], s["num_failed"]) == (2, 1)
    assert s["failures"] == {"connect": 1}
    assert s["connection_failures"] == 1
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput_tok_s"] == pytest.approx(5 / 2)
    assert s["total_throughput_tok_s"] == pytest.approx((5 + 16) / 2)
    assert s["peak_output_throughput_tok_s"] == 4  # bucket [1 s, 2 s) holds 1 + 2 + 1
    # in flight: 0.55 + 0.35 + 0.1 (the failed request counts too) over 2 s
    assert s["mean_in_flight"] == pytest.approx(0.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(250.0)
    assert s["ttft_ms"]["std"] == pytest.approx(50.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(250.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(299.0)
    assert s["ttft_ms"]["max"] == pytest.approx(300.0)
    assert s["tpot_ms"]["count"] == 1 and s["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert s["chunk_tokens"]["histogram"] == {"1": 3, "2": 1}
    assert s["token_count_check"]["output_mismatched"] == 1
    assert s["token_count_check"]["output_server_total"] == 5
    assert s["token_count_check"]["output_client_total"] == 4
    # $/1M output tokens = 3.6 $/h x 2 GPUs / (2.5 tok/s x 3600) x 1e6
    assert s["cost_per_1m_output_tokens"] == pytest.approx(800.0)
    assert s["cost_per_1m_total_tokens"] == pytest.approx(7.2 / (10.5 * 3600) * 1e6)
    assert s["goodput_req_s"] is None and s["slo_attainment"] is None
    # the failed request was planned at 0.4 s and sent at 0.5 s
    assert s["generator_lag_s"] == pytest.approx(0.1)
    assert s["generator_lag_warning"] is False  # 0.1 s is exactly 5% of 2 s


def test_slo_edges_are_inclusive_and_failures_never_meet():
    a, b, c = chat_record(), one_token_record(), failed_record()
    at_edge = SLO(ttft_ms=200, tpot_ms=100)  # a sits exactly on both limits
    assert at_edge.met(a)
    assert not at_edge.met(b)  # TTFT 300 ms
    assert not at_edge.met(c)
    assert not SLO(ttft_ms=199.9).met(a)
    assert not SLO(e2e_ms=499.9).met(a) and SLO(e2e_ms=500).met(a)
    assert SLO(tpot_ms=1).met(b)  # a 1-token output has no TPOT to violate
    s = metrics.summarize([a, b, c], duration_s=2.0, slo=at_edge)
    assert s["goodput_req_s"] == pytest.approx(0.5)
    assert s["slo_attainment"] == pytest.approx(100 / 3)


def test_slo_parse():
    assert SLO.parse(["ttft_ms=500", "tpot_ms=50"]) == SLO(ttft_ms=500, tpot_ms=50)
    assert SLO.parse(["ttft_ms=1,e2e_ms=2"]) == SLO(ttft_ms=1, e2e_ms=2)
    assert SLO.parse(None) is None
    with pytest.raises(ValueError, match="invalid SLO"):
        SLO.parse(["ttft=5"])


def test_lag_warning_over_five_percent():
    r = one_token_record()
    r.planned_time_s, r.send_time_s = 0.0, 0.1
    r.chunk_times_s, r.end_time_s = [0.4], 1.0
    assert metrics.summarize([r], duration_s=1.0)["generator_lag_warning"] is True


def test_empty_run_has_no_latency_numbers():
    s = metrics.summarize([failed_record()], duration_s=1.0)
    assert s["num_completed"] == 0
    assert s["ttft_ms"]["p50"] is None and s["ttft_ms"]["count"] == 0
    assert s["output_throughput_tok_s"] == 0


def test_bench_page_carries_the_help_definitions_verbatim():
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "bench.md"
    assert metrics.METRIC_DEFINITIONS in doc.read_text()
    assert metrics.SERVER_CLIENT_DEFINITIONS in doc.read_text()


def test_pooled_itl_counts_the_tokens_the_stream_never_showed():
    """A server's ITL histogram sees every token; the stream may not show them all."""
    hidden = one_token_record()
    hidden.chunk_times_s, hidden.chunk_tokens = [0.3, 0.8], [1, 1]
    hidden.usage_completion_tokens = 6  # 4 generated tokens carried no text
    s = metrics.summarize([chat_record(), hidden, one_token_record()], duration_s=2.0)
    # (0.3 s over 3 gaps + 0.5 s over 5 gaps) / 8 gaps; the 1-token output has none
    assert s["itl_pooled_ms"] == pytest.approx(1e3 * 0.8 / 8)
    assert s["itl_ms"]["mean"] > s["itl_pooled_ms"]  # chunk gaps miss the hidden tokens
