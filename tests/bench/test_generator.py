"""The load generator itself: what it cost (CPU, event-loop lag, the same-host warning)
and `--workers N` (sharded processes, one clock, merged results)."""

import os
import threading

import pytest

from tests.bench.fakes import FakeServer, WordTokenizer
from tokenmill.bench import runner
from tokenmill.bench.client import ClientOptions
from tokenmill.bench.client_cost import is_same_host
from tokenmill.bench.workers import split_concurrency
from tokenmill.bench.workload import BenchRequest


@pytest.fixture(scope="module")
def fake():
    with FakeServer() as srv:
        yield srv


def run(fake, load, n=12, workers=1, **fake_opts):
    opts = ClientOptions(base_url=fake.base_url, model="fake",
                         extra_body={"fake": {"ttft_ms": 20, "gap_ms": 5, **fake_opts}})
    reqs = [BenchRequest(f"p{i} q", 2, 6) for i in range(n)]
    plan = runner.BenchPlan(runner.HttpTarget(opts, WordTokenizer(), workers=workers),
                            {"model": "fake"}, lambda i: reqs, seed=3)
    return runner.run_once(plan, load)


def test_client_cost_fields_are_present_and_plausible(fake):
    res = run(fake, runner.LoadSpec(concurrency=4))
    c = res["client"]
    assert c["num_cpus"] == os.cpu_count()
    assert c["wall_s"] == pytest.approx(res["summary"]["duration_s"], rel=0.05)
    assert 0 < c["cpu_seconds"] <= c["wall_s"] * c["num_cpus"] * 1.05
    assert c["cpu_share"] == pytest.approx(c["cpu_seconds"] / (c["wall_s"] * c["num_cpus"]))
    assert 0 < c["loop_thread_cpu_seconds"] <= c["cpu_seconds"] + 1e-3
    assert c["loop_lag_ms"]["count"] > 0 and c["loop_lag_ms"]["max"] >= 0
    assert c["same_host"] is True and c["workers"] == 1


def test_a_busy_client_on_the_server_host_is_flagged(fake):
    stop = threading.Event()

    def spin() -> None:  # the client process burns a core while it generates load
        while not stop.is_set():
            sum(range(10_000))

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        busy = run(fake, runner.LoadSpec(concurrency=2), n=8, gap_ms=40)
    finally:
        stop.set()
        spinner.join()
    c = busy["client"]
    assert c["cpu_share"] > 0.10 and c["warning"] is True, c
    assert any("same host as the server" in n for n in busy["notes"])
    # the spinning thread holds the GIL, so the event loop wakes late too
    assert c["loop_lag_ms"]["max"] > 1.0


def test_same_host_detection():
    assert is_same_host("http://127.0.0.1:8000") and is_same_host("http://localhost:1")
    assert is_same_host("http://[::1]:8000")
    assert not is_same_host("http://192.0.2.7:8000")  # TEST-NET-1, never this host


def test_concurrency_is_split_without_zero_shares():
    assert split_concurrency(5, 2) == [3, 2]
    assert split_concurrency(None, 3) == [None, None, None]
    assert sum(split_concurrency(17, 4)) == 17


def _accounting(res):
    s = res["summary"]
    return (s["num_requests"], s["num_completed"], s["num_failed"], s["total_output_tokens"],
            s["total_input_tokens"], sorted(r["id"] for r in res["requests"]))


def test_two_workers_give_the_same_accounting_as_one(fake):
    one = run(fake, runner.LoadSpec(concurrency=4), n=16)
    two = run(fake, runner.LoadSpec(concurrency=4), n=16, workers=2)
    assert _accounting(two) == _accounting(one)
    assert two["client"]["workers"] == 2
    # one clock: every timestamp of either worker falls inside the merged run
    for r in two["requests"]:
        assert 0 <= r["send_time_s"] <= r["chunk_times_s"][0] <= r["end_time_s"]
        assert r["end_time_s"] <= two["summary"]["duration_s"] + 1e-6
    reqs = two["requests"]
    for r in reqs:  # the global limit of 4 in flight holds across both processes
        in_flight = sum(1 for o in reqs if o["send_time_s"] <= r["send_time_s"] < o["end_time_s"])
        assert in_flight <= 4


def test_workers_follow_the_same_seeded_schedule(fake):
    load = runner.LoadSpec(request_rate=40.0)
    one = run(fake, load, n=10)
    two = run(fake, load, n=10, workers=2)
    assert [r["planned_time_s"] for r in two["requests"]] == \
        [r["planned_time_s"] for r in one["requests"]]
    for r in two["requests"]:
        assert r["send_time_s"] >= r["planned_time_s"] - 1e-6
