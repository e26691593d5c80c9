"""`tokenmill bench sweep`: one result per point, the Pareto front of tok/s per user vs
per device in the JSON and the plot, the knee named by `explain`, and two sweeps'
fronts overlaid in the comparison."""

import json

import pytest

from tests.bench.fakes import FakeServer
from tokenmill.bench.pareto import X_KEY, Y_KEY, front_indices, pareto_section
from tokenmill.cli import main as cli_main


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    prompts = d / "p.json"
    prompts.write_text(json.dumps([f"prompt number {i}" for i in range(32)]))
    with FakeServer() as srv, pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        common = ["bench", "sweep", "--base-url", srv.base_url, "--dataset", "jsonl",
                  "--dataset-path", str(prompts), "--output-len", "8", "--num-requests", "8",
                  "--no-progress", "--no-scrape", "--concurrency", "1,2,4,8",
                  "--slo", "tpot_ms=30"]
        # the fake serves each stream at a fixed pace (one token per 5 ms after 20 ms)...
        assert cli_main([*common, "--extra-body", '{"fake": {"ttft_ms": 20, "gap_ms": 5}}',
                         "--output", str(d / "a.json"), "--html", str(d / "a.html")]) == 0
        # ...and b spends 1 ms of its one event loop per token: streams slow each other
        assert cli_main([*common, "--extra-body",
                         '{"fake": {"ttft_ms": 20, "gap_ms": 5, "cpu_ms_per_chunk": 2}}',
                         "--output", str(d / "b.json")]) == 0
    return d


def test_sweep_json_has_a_monotone_front_and_one_file_per_point(sweep):
    res = json.loads((sweep / "a.json").read_text())
    par = res["pareto"]
    assert len(res["runs"]) == len(par["points"]) == 4
    assert [p["concurrency"] for p in par["points"]] == [1, 2, 4, 8]
    front = res["pareto_front"]
    assert front == par["front"] and len(front) >= 2
    xs, ys = [p[X_KEY] for p in front], [p[Y_KEY] for p in front]
    assert xs == sorted(xs) and ys == sorted(ys, reverse=True)  # monotone
    for p in par["points"]:  # nothing off the front beats a front point on both axes
        assert not any(p[X_KEY] > q[X_KEY] and p[Y_KEY] > q[Y_KEY] for q in front)
    assert par["slo_tok_s_per_user"] == pytest.approx(1000 / 30)
    assert par["knee"][Y_KEY] >= par["slo_tok_s_per_user"]
    for c in (1, 2, 4, 8):
        point = json.loads((sweep / f"a.c{c}.json").read_text())
        assert point["config"]["concurrency"] == c and "runs" not in point


def test_the_plot_draws_the_front_and_the_slo_line_from_the_json(sweep):
    from tokenmill.bench.pareto import pareto_figure
    from tokenmill.bench.plots import pyplot

    res = json.loads((sweep / "a.json").read_text())
    fig = pareto_figure(pyplot(), [res], ["a"])
    ax = fig.axes[0]
    front_line = next(ln for ln in ax.get_lines() if ln.get_label() == "a front")
    assert list(front_line.get_xdata()) == [p[X_KEY] for p in res["pareto_front"]]
    assert list(front_line.get_ydata()) == [p[Y_KEY] for p in res["pareto_front"]]
    slo_line = next(ln for ln in ax.get_lines() if ln.get_label().startswith("SLO"))
    assert list(slo_line.get_ydata()) == [res["pareto"]["slo_tok_s_per_user"]] * 2
    pyplot().close("all")
    page = (sweep / "a.html").read_text()
    assert '<figure id="plot-pareto">' in page


def test_explain_names_the_knee(sweep, capsys):
    res = json.loads((sweep / "a.json").read_text())
    cli_main(["explain", str(sweep / "a.json")])
    out = capsys.readouterr().out
    assert f"knee of the Pareto front at concurrency {res['pareto']['knee']['concurrency']}" \
        in out


def test_compare_overlays_two_fronts(sweep, capsys):
    assert cli_main(["bench", "--compare", str(sweep / "a.json"), str(sweep / "b.json"),
                     "--html", str(sweep / "ab.html")]) == 0
    page = (sweep / "ab.html").read_text()
    assert '<figure id="plot-pareto">' in page


def test_front_of_known_points():
    pts = [{X_KEY: x, Y_KEY: y} for x, y in ((10, 100), (30, 90), (25, 80), (60, 40),
                                             (80, 10), (70, 5))]
    assert front_indices(pts) == [0, 1, 3, 4]
    runs = [{"summary": {"output_throughput_tok_s": x, "tpot_ms": {"mean": 1000 / y}},
             "config": {"concurrency": c}} for c, (x, y) in enumerate(
                 ((10, 100), (30, 90), (60, 40), (80, 10)), 1)]
    par = pareto_section(runs, "concurrency")
    assert par["knee"]["concurrency"] == 2  # where throughput stops being cheap
    assert pareto_section(runs, "concurrency", tpot_slo_ms=26)["knee"]["concurrency"] == 3


def test_a_list_without_sweep_is_refused(capsys):
    assert cli_main(["bench", "--base-url", "http://127.0.0.1:9",
                     "--concurrency", "1,4"]) == 2
    assert "tokenmill bench sweep --concurrency 1,4" in " ".join(capsys.readouterr().err.split())
