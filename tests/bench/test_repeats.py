"""`--repeats N`: means with 95% intervals that contain them and shrink with more runs;
two servers alternated A B B A with B/A and its interval."""

import math

import pytest

from tests.bench.fakes import FakeTarget
from tokenmill.bench import runner
from tokenmill.bench.confidence import mean_ci95, ratio_ci95, t_quantile_975
from tokenmill.bench.repeats import HEADLINE, abba_order, run_repeats
from tokenmill.bench.workload import BenchRequest


def repeated(n: int, targets: list[FakeTarget]) -> dict:
    reqs = [BenchRequest(f"p{i}", 4, 8) for i in range(8)]
    plans = [runner.BenchPlan(t, {"model": "fake"}, lambda k: reqs) for t in targets]
    load = runner.LoadSpec(concurrency=2)
    return run_repeats(lambda s, k: runner.run_once(plans[s], load, run_index=k), n,
                       num_servers=len(plans))


def test_intervals_contain_the_mean_and_shrink_with_more_repeats():
    widths = {}
    for n in (3, 10):
        rep = repeated(n, [FakeTarget(seed=1)])["repeats"]
        assert rep["n"] == n
        for name in HEADLINE:
            m = rep["metrics"][name]
            if name.startswith("goodput"):  # no SLO: goodput is every request
                continue
            lo, hi = m["ci95"]
            assert lo < m["mean"] < hi and m["n"] == n, name
            assert min(m["values"]) <= m["mean"] <= max(m["values"])
        tp = rep["metrics"]["output_throughput_tok_s"]
        widths[n] = tp["ci95"][1] - tp["ci95"][0]
        # 2 streams of 8 tokens in 50 + 7 × 10 ms, the fake's speed varied ±10%
        assert 2 * 8 / 0.12 / 1.1 < tp["mean"] < 2 * 8 / 0.12 / 0.9
    assert widths[10] < 0.7 * widths[3]


def test_two_servers_alternate_abba_and_the_ratio_has_an_interval():
    a, b = FakeTarget(seed=1), FakeTarget(gap_s=0.02, ttft_s=0.1, seed=2)
    out = repeated(4, [a, b])
    assert abba_order(4) == [0, 1, 1, 0, 0, 1, 1, 0]
    assert a.calls == b.calls == 4
    ratio = out["repeats"]["versus"]["ratio_b_over_a"]["output_throughput_tok_s"]
    lo, hi = ratio["ci95"]
    assert lo < ratio["ratio"] < hi < 0.75  # B is about half as fast
    ttft = out["repeats"]["versus"]["ratio_b_over_a"]["ttft_ms_p50"]
    assert ttft["ci95"][0] > 1.5  # B's first token takes twice as long


def test_interval_arithmetic():
    m = mean_ci95([1.0, 2.0, 3.0])
    assert m["mean"] == 2.0 and m["std"] == 1.0
    half = t_quantile_975(2) / math.sqrt(3)
    assert m["ci95"] == pytest.approx([2 - half, 2 + half])
    assert mean_ci95([5.0])["ci95"] is None
    r = ratio_ci95([10.0, 10.0, 10.0], [20.0, 20.0, 20.0])
    assert r["ratio"] == pytest.approx(2.0) and r["ci95"] == pytest.approx([2.0, 2.0])
    with pytest.raises(ValueError, match="at least 2"):
        run_repeats(lambda s, k: {}, 1)


def test_cli_repeats_versus_writes_intervals(tmp_path, monkeypatch):
    import json

    from tests.bench.fakes import FakeServer
    from tokenmill.cli import main as cli_main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([f"prompt number {i}" for i in range(8)]))
    with FakeServer() as a, FakeServer() as b:
        out = tmp_path / "r.json"
        assert cli_main(["bench", "--base-url", a.base_url, "--versus", b.base_url,
                         "--repeats", "2", "--dataset", "jsonl", "--dataset-path",
                         str(prompts), "--output-len", "4", "--num-requests", "4",
                         "--concurrency", "2", "--no-progress", "--no-scrape",
                         "--extra-body", '{"fake": {"ttft_ms": 5, "gap_ms": 2}}',
                         "--output", str(out)]) == 0
        assert len(a.bodies) == len(b.bodies) == 8  # 2 repeats × 4 requests each
    res = json.loads(out.read_text())
    tp = res["repeats"]["metrics"]["output_throughput_tok_s"]
    assert tp["n"] == 2 and tp["ci95"][0] <= tp["mean"] <= tp["ci95"][1]
    assert res["repeats"]["versus"]["ratio_b_over_a"]["output_throughput_tok_s"]["n"] == 2
    assert len(res["runs"]) == len(res["versus_runs"]) == 2
