"""The streaming client, load generator and command against a fake SSE server with a known
chunk schedule (a test of the client and metrics, not of any engine)."""

import json
import struct

import numpy as np
import pytest

from tests.bench.fakes import FakeServer, WordTokenizer
from tokenmill.bench import runner
from tokenmill.bench.client import ClientOptions
from tokenmill.bench.workload import BenchRequest
from tokenmill.cli import main as cli_main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def fake():
    with FakeServer() as srv:
        yield srv


def run(fake, load, n=8, endpoint="completions", base_url=None, **fake_opts):
    opts = ClientOptions(base_url=base_url or fake.base_url, model="fake", endpoint=endpoint,
                         extra_body={"fake": fake_opts})
    target = runner.HttpTarget(opts, WordTokenizer())
    reqs = [BenchRequest(f"p{i} q", 2, 6) for i in range(n)]
    plan = runner.BenchPlan(target, {"model": "fake", "backend": "openai"}, lambda i: reqs)
    return runner.run_once(plan, load), target


def test_lora_modules_spread_the_requests_evenly_over_the_adapters(fake):
    opts = ClientOptions(base_url=fake.base_url, model="fake", lora_modules=["a", "b", "c"])
    target = runner.HttpTarget(opts, WordTokenizer())
    reqs = [BenchRequest(f"p{i} q", 2, 6) for i in range(6)]
    plan = runner.BenchPlan(target, {"model": "fake", "backend": "openai"}, lambda i: reqs)
    before = len(fake.bodies)
    runner.run_once(plan, runner.LoadSpec(concurrency=1))
    assert [b["model"] for b in fake.bodies[before:]] == ["a", "b", "c"] * 2


def test_chat_role_chunk_is_not_ttft_and_chunks_are_timed(fake):
    # relations between the recorded timestamps, never durations (the machine may be busy)
    result, _ = run(fake, runner.LoadSpec(concurrency=2), endpoint="chat", ttft_ms=150,
                    gap_ms=40, chunk_tokens=2)
    s = result["summary"]
    assert s["num_completed"] == 8 and s["num_failed"] == 0
    ttfts, e2es, samples = [], [], []
    for r in result["requests"]:
        # the role-only chunk arrives first and is not a content chunk
        assert r["first_chunk_time_s"] < r["chunk_times_s"][0]
        assert len(r["chunk_times_s"]) == 3 and r["chunk_tokens"] == [2, 2, 2]
        assert r["chunk_times_s"] == sorted(r["chunk_times_s"])
        # TTFT = first content chunk - send; E2E = last content chunk - send
        assert r["ttft_s"] == pytest.approx(r["chunk_times_s"][0] - r["send_time_s"], abs=2e-6)
        assert r["e2e_s"] == pytest.approx(r["chunk_times_s"][-1] - r["send_time_s"], abs=2e-6)
        assert r["send_time_s"] <= r["first_chunk_time_s"] <= r["end_time_s"]
        assert r["output_tokens_server"] == r["output_tokens_client"] == 6
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 5, abs=2e-6)
        ttfts.append(r["ttft_s"])
        e2es.append(r["e2e_s"])
        times = r["chunk_times_s"]
        for gap in np.diff(times):
            samples += [gap / 2] * 2  # a 2-token chunk: two samples of half its gap
    assert s["ttft_ms"]["p50"] == pytest.approx(1e3 * float(np.median(ttfts)), abs=1e-2)
    assert s["e2e_ms"]["mean"] == pytest.approx(1e3 * float(np.mean(e2es)), abs=1e-2)
    assert s["itl_ms"]["count"] == len(samples) == 8 * 4  # two 2-token gaps per request
    assert s["itl_ms"]["mean"] == pytest.approx(1e3 * float(np.mean(samples)), abs=1e-2)
    assert s["chunk_tokens"]["histogram"] == {"2": 24}
    assert s["token_count_check"]["output_mismatched"] == 0


def test_concurrency_limit_is_respected(fake):
    result, _ = run(fake, runner.LoadSpec(concurrency=3), n=9, ttft_ms=60, gap_ms=10)
    reqs = result["requests"]
    for r in reqs:
        in_flight = sum(1 for o in reqs if o["send_time_s"] <= r["send_time_s"] < o["end_time_s"])
        assert in_flight <= 3
        assert r["send_time_s"] >= r["planned_time_s"] - 1e-6
    assert result["summary"]["mean_in_flight"] <= 3.0
    # lag is actual send - planned send, worst over the run
    lags = [max(0.0, r["send_time_s"] - r["planned_time_s"]) for r in reqs]
    assert result["summary"]["generator_lag_s"] == pytest.approx(max(lags), abs=2e-6)


def test_rate_mode_follows_the_schedule(fake):
    result, _ = run(fake, runner.LoadSpec(request_rate=20.0), n=10, ttft_ms=10, gap_ms=5)
    reqs = result["requests"]
    planned = [r["planned_time_s"] for r in reqs]
    assert planned == sorted(planned) and planned[0] == 0.0 and planned[-1] > 0.1
    for r in reqs:
        assert r["send_time_s"] >= r["planned_time_s"] - 1e-6
    assert result["summary"]["num_completed"] == 10


def test_server_dying_mid_stream_is_a_disconnected_failure(fake):
    result, _ = run(fake, runner.LoadSpec(concurrency=4), n=4, die_after=2)
    s = result["summary"]
    assert s["num_failed"] == 4 and s["failures"] == {"disconnected": 4}
    assert all(len(r["chunk_times_s"]) == 2 for r in result["requests"])


def test_unreachable_server_is_a_connect_failure():
    from tests.serving import free_port

    result, _ = run(None, runner.LoadSpec(concurrency=2), n=3,
                    base_url=f"http://127.0.0.1:{free_port()}")
    assert result["summary"]["failures"] == {"connect": 3}


def test_http_errors_are_counted_by_status(fake):
    result, _ = run(fake, runner.LoadSpec(), n=3, status=503)
    assert result["summary"]["failures"] == {"http_503": 3}


def test_a_server_that_rejects_ignore_eos_gets_requests_without_it(fake):
    result, _ = run(fake, runner.LoadSpec(concurrency=2), n=4, reject="ignore_eos")
    s = result["summary"]
    assert s["num_completed"] == 4 and s["num_failed"] == 0
    assert result["config"]["dropped_request_fields"] == ["ignore_eos"]
    assert any("rejected ignore_eos" in note for note in result["notes"])


def test_usage_mismatch_is_reported(fake):
    result, _ = run(fake, runner.LoadSpec(), n=2, usage_delta=1)
    check = result["summary"]["token_count_check"]
    assert check["output_mismatched"] == 2
    assert any("differ between server usage and client" in n for n in result["notes"])


def test_sweep_and_search(fake):
    reqs = [BenchRequest("p q", 2, 4) for _ in range(6)]
    opts = ClientOptions(base_url=fake.base_url, model="fake",
                         extra_body={"fake": {"ttft_ms": 20, "gap_ms": 5}})
    from tokenmill.bench.metrics import SLO

    plan = runner.BenchPlan(runner.HttpTarget(opts, WordTokenizer()), {"model": "fake"},
                            lambda i: reqs, slo=SLO(ttft_ms=5000))
    sweep = runner.run_sweep(plan, runner.LoadSpec(), "concurrency", [1, 3])
    assert [r["config"]["concurrency"] for r in sweep["runs"]] == [1, 3]
    assert sweep["summary"] is sweep["runs"][sweep["summary_run_index"]]["summary"]
    search = runner.search_max_rate(plan, runner.LoadSpec(), 90.0, start_rate=50.0,
                                    iterations=1)
    # everything passes a 5 s TTFT SLO, so the search only doubles, up to its cap
    assert search["search"]["max_rate_req_s"] >= 100.0
    assert all(p["passed"] for p in search["search"]["probes"])


def _png_ok(path) -> bool:
    data = path.read_bytes()
    if not data.startswith(PNG_SIGNATURE):
        return False
    width, height = struct.unpack(">II", data[16:24])
    return width >= 400 and height >= 300 and len(data) > 5000


def test_command_writes_json_and_plots(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([f"prompt number {i}" for i in range(12)]))
    out = tmp_path / "res.json"
    code = cli_main(["bench", "--base-url", fake.base_url, "--dataset", "jsonl",
                     "--dataset-path", str(prompts), "--output-len", "5",
                     "--num-requests", "4", "--sweep", "concurrency=1,2",
                     "--slo", "ttft_ms=2000", "--cost-per-hour", "2",
                     "--extra-body", '{"fake": {"ttft_ms": 5, "gap_ms": 2}}',
                     "--output", str(out), "--plot", str(tmp_path / "plots"),
                     "--no-progress"])
    assert code == 0, capsys.readouterr()
    res = json.loads(out.read_text())
    assert res["config"]["model"] == "fake-model"  # from /v1/models
    assert len(res["runs"]) == 2
    assert res["runs"][0]["summary"]["slo_attainment"] == 100.0
    assert res["summary"]["cost_per_1m_output_tokens"] > 0
    for name in ("ttft_cdf", "tpot_cdf", "timeline", "frontier", "goodput"):
        assert _png_ok(tmp_path / "plots" / f"{name}.png"), name


def test_command_exits_nonzero_when_the_server_dies(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(f"p {i}") for i in range(4)))
    code = cli_main(["bench", "--base-url", fake.base_url, "--dataset", "jsonl",
                     "--dataset-path", str(prompts), "--num-requests", "4",
                     "--extra-body", '{"fake": {"die_after": 1}}', "--no-progress",
                     "--output", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 1
    assert "did the server die" in err and "disconnected: 4" in err
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["summary"]["num_failed"] == 4


def test_command_unreachable_server_message(capsys):
    from tests.serving import free_port

    code = cli_main(["bench", "--base-url", f"http://127.0.0.1:{free_port()}"])
    assert code == 1
    assert "cannot reach" in capsys.readouterr().err


def test_command_rejects_bad_arguments(capsys):
    assert cli_main(["bench"]) == 2
    assert "--base-url" in capsys.readouterr().err
    assert cli_main(["bench", "--base-url", "http://x", "--max-rate-under-slo"]) == 2
    assert cli_main(["bench", "--base-url", "http://x", "--sweep", "foo=1"]) == 2
    assert cli_main(["bench", "--offline", "smollm2-135m", "--workers", "2"]) == 2
    assert cli_main(["bench", "--base-url", "http://x", "--dataset", "random",
                     "--turns", "3"]) == 2


def test_duration_cycles_prompts_and_stops_sending(fake):
    opts = ClientOptions(base_url=fake.base_url, model="fake",
                         extra_body={"fake": {"ttft_ms": 5, "gap_ms": 2}})
    reqs = [BenchRequest(f"p{i}", 1, 3) for i in range(3)]
    plan = runner.BenchPlan(runner.HttpTarget(opts, WordTokenizer()), {"model": "fake"},
                            lambda i: reqs)
    result = runner.run_once(plan, runner.LoadSpec(request_rate=40.0, duration_s=0.5))
    planned = [r["planned_time_s"] for r in result["requests"]]
    assert len(planned) > 5  # more than the 3 prompts: they cycle
    assert max(planned) < 0.5
    assert result["summary"]["num_failed"] == 0


def test_warmup_requests_are_not_measured(fake):
    opts = ClientOptions(base_url=fake.base_url, model="fake",
                         extra_body={"fake": {"ttft_ms": 5, "gap_ms": 2}})
    reqs = [BenchRequest(f"p{i}", 1, 3) for i in range(5)]
    plan = runner.BenchPlan(runner.HttpTarget(opts, WordTokenizer()), {"model": "fake"},
                            lambda i: reqs, warmup=2)
    result = runner.run_once(plan, runner.LoadSpec(concurrency=2))
    assert result["summary"]["num_requests"] == 3
    assert result["config"]["warmup"] == 2
