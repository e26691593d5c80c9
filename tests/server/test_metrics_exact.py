"""`/metrics` counts exactly what was served: around a known set of requests every counter
and histogram count moves by the amount those requests imply, not merely upwards.

Runs on the shared session server, which is idle between tests (pytest runs them one at a
time and the disconnect tests wait until the KV cache is free)."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

MODEL = "smollm2-135m"
HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds",
              "inter_token_latency_seconds")
COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
            "prefix_cache_hits_total", "num_preemptions_total",
            "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
            "spec_decode_num_drafts_total")


def scrape(base_url: str) -> dict[str, float]:
    """Every sample, keyed by name plus labels other than model_name."""
    samples: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if not line.startswith("tokenmill:"):
            continue
        key, value = line.rsplit(" ", 1)
        name, _, labels = key.partition("{")
        extra = ",".join(part for part in labels.rstrip("}").split(",")
                         if part and not part.startswith("model_name="))
        samples[f"tokenmill:{name[len('tokenmill:'):]}" + (f"{{{extra}}}" if extra else "")] = (
            float(value))
    return samples


def wait_idle(base_url: str, timeout_s: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = scrape(base_url)
        if (m["tokenmill:num_requests_running"] == 0 and m["tokenmill:num_requests_waiting"] == 0
                and m["tokenmill:kv_cache_usage_perc"] == 0):
            return m
        time.sleep(0.1)
    raise AssertionError("server not idle")


# a high-water mark of the pool's first use, not a per-request count: it moves only
# while the server touches blocks it never used before
FIRST_USE = ("tokenmill:kv_cache_committed_bytes",)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after
            if after[k] != before.get(k, 0.0) and k not in FIRST_USE}


def complete(base_url: str, prompt: list[int], max_tokens: int, stream: bool = False) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        return sum(1 for line in r.iter_lines() if line.startswith('data: {"id"'))


def test_counters_and_histograms_move_by_exactly_what_was_served(server):
    rng = random.Random(2025)
    # 40 tokens = 2 full blocks of 16 + 8: a repeat finds the 32 tokens of its full blocks
    first = [rng.randrange(1000, 40000) for _ in range(40)]
    other = [rng.randrange(1000, 40000) for _ in range(21)]
    before = wait_idle(server.base_url)
    assert complete(server.base_url, first, 5) == 5
    assert complete(server.base_url, first, 7) == 7  # the same prompt: a prefix-cache hit
    chunks = complete(server.base_url, other, 6, stream=True)
    after = wait_idle(server.base_url)
    d = delta(after, before)
    total_prompt = 40 + 40 + 21
    expected = {
        'tokenmill:request_success_total{finished_reason="length"}': 3,
        "tokenmill:prompt_tokens_total": total_prompt,
        "tokenmill:generation_tokens_total": 5 + 7 + 6,
        "tokenmill:prefix_cache_queries_total": total_prompt,
        "tokenmill:prefix_cache_hits_total": 32,
    }
    for name in HISTOGRAMS[:4]:  # one observation per request
        expected[f"tokenmill:{name}_count"] = 3
    # one gap between consecutive outputs: a token per step, so max_tokens - 1 per request
    expected["tokenmill:inter_token_latency_seconds_count"] = 4 + 6 + 5
    # the names vLLM's dashboard reads (issue 60): one observation per request ...
    for name in ("request_decode_time_seconds", "request_generation_tokens",
                 "request_inference_time_seconds", "request_prompt_tokens",
                 "request_max_num_generation_tokens", "request_params_n",
                 "request_params_max_tokens"):
        expected[f"tokenmill:{name}_count"] = 3
    # ... time per output token as the inter-token gaps, and one per step (18 steps: each
    # request ran alone, a prefill step and one step a token after it)
    expected["tokenmill:time_per_output_token_seconds_count"] = 4 + 6 + 5
    expected["tokenmill:iteration_tokens_total_count"] = 5 + 7 + 6
    got = {k: v for k, v in d.items() if not k.endswith(("_sum", "_bucket", "_created"))
           and "_bucket{" not in k}
    assert got == expected
    assert chunks == 6  # streamed: one SSE chunk per token
    for name in COUNTERS:
        if name not in ("prompt_tokens_total", "generation_tokens_total",
                        "prefix_cache_queries_total", "prefix_cache_hits_total"):
            assert d.get(f"tokenmill:{name}", 0) == 0, name  # no preemption, no speculation
    # each histogram's +Inf bucket moved with its count
    for name in HISTOGRAMS:
        inf = f'tokenmill:{name}_bucket{{le="+Inf"}}'
        assert d.get(inf, 0) == expected[f"tokenmill:{name}_count"], name


@pytest.mark.slow
def test_speculative_decoding_counters():
    """A server of its own with ngram speculation: the spec counters agree with the
    gauges and with the tokens served."""
    from tests.serving import start_server

    srv = start_server(MODEL, "--speculative", "ngram", "--no-prefix-caching")
    try:
        rng = random.Random(7)
        span = [rng.randrange(1000, 40000) for _ in range(12)]
        grounded = span + span + span[:6]  # repeats itself: ngram drafts get proposed
        before = wait_idle(srv.base_url)
        assert complete(srv.base_url, grounded, 24) == 24
        after = wait_idle(srv.base_url)
    finally:
        srv.stop()
    d = delta(after, before)
    assert d["tokenmill:generation_tokens_total"] == 24
    assert d["tokenmill:prompt_tokens_total"] == len(grounded)
    assert d['tokenmill:request_success_total{finished_reason="length"}'] == 1
    drafts = d["tokenmill:spec_decode_num_drafts_total"]
    proposed = d["tokenmill:spec_decode_num_draft_tokens_total"]
    accepted = d.get("tokenmill:spec_decode_num_accepted_tokens_total", 0)
    assert drafts >= 1 and proposed >= drafts and 0 <= accepted <= proposed
    # the gauges are ratios of the counters (one request so far: its own)
    assert after["tokenmill:spec_decode_draft_acceptance_rate"] == pytest.approx(
        accepted / proposed)
    assert after["tokenmill:spec_decode_mean_accepted_length"] == pytest.approx(
        1 + accepted / drafts)
    # one ITL gap per step: the accepted drafts of a step arrive together
    assert d["tokenmill:inter_token_latency_seconds_count"] <= 24 - 1 - accepted
    assert d.get("tokenmill:num_preemptions_total", 0) == 0


@pytest.mark.slow
def test_preemption_counts_no_prompt_token_or_request_twice():
    """A server of its own with 8 KV blocks (128 tokens): two sequences that need 7 + 5
    of them, the later one preempted and recomputed."""
    import threading

    from tests.serving import start_server

    srv = start_server(MODEL, "--num-kv-blocks", "8", "--max-num-seqs", "2",
                       "--no-prefix-caching")
    try:
        rng = random.Random(8)
        a = [rng.randrange(1000, 40000) for _ in range(40)]
        b = [rng.randrange(1000, 40000) for _ in range(40)]
        served = {}
        before = wait_idle(srv.base_url)
        body = {"model": MODEL, "prompt": a, "max_tokens": 70, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body,
                          timeout=300) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # A is running
            later = threading.Thread(
                target=lambda: served.update(b=complete(srv.base_url, b, 30)))
            later.start()
            rest = [line for line in lines if line.startswith("data: {")]
        served["a"] = json.loads(rest[-1][6:])["usage"]["completion_tokens"]
        later.join(300)
        after = wait_idle(srv.base_url)
    finally:
        srv.stop()
    d = delta(after, before)
    assert served == {"a": 70, "b": 30}
    assert d["tokenmill:num_preemptions_total"] >= 1
    assert d['tokenmill:request_success_total{finished_reason="length"}'] == 2
    assert d["tokenmill:prompt_tokens_total"] == 80
    assert d["tokenmill:generation_tokens_total"] == 100  # recomputed tokens: not again
    for name in HISTOGRAMS[:4]:
        assert d[f"tokenmill:{name}_count"] == 2, name
