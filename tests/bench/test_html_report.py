"""The HTML report and the comparison: self-contained, every section present, and
rendered by a real headless Chromium (no console errors, images loaded, the numbers in
the DOM)."""

import json
import re
import shutil
import struct
import subprocess

import pytest

from tests.bench.fakes import FakeServer
from tokenmill.bench.compare import compare_rows
from tokenmill.bench.html_report import render_comparison, render_report
from tokenmill.cli import main as cli_main

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser",
                                                "google-chrome")) if p), None)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--enable-logging=stderr",
                  "--v=0"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A sweep against the vLLM-metrics stub (so: runs, frontier, server section), its
    HTML report, and a second single run to compare with."""
    d = tmp_path_factory.mktemp("html")
    prompts = d / "p.json"
    prompts.write_text(json.dumps([f"prompt number {i}" for i in range(16)]))
    with FakeServer(vllm_metrics=True) as srv, pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        common = ["bench", "--base-url", srv.base_url, "--dataset", "jsonl",
                  "--dataset-path", str(prompts), "--output-len", "6", "--num-requests", "6",
                  "--no-progress", "--scrape-interval", "0.1"]
        assert cli_main([*common, "--sweep", "concurrency=1,3", "--slo", "ttft_ms=1000",
                         "--extra-body", '{"fake": {"ttft_ms": 20, "gap_ms": 5}}',
                         "--output", str(d / "a.json"), "--html", str(d / "a.html")]) == 0
        assert cli_main([*common, "--concurrency", "3",
                         "--extra-body", '{"fake": {"ttft_ms": 60, "gap_ms": 5}}',
                         "--output", str(d / "b.json")]) == 0
    return d


def test_report_is_self_contained_with_every_section(results):
    page = (results / "a.html").read_text()
    res = json.loads((results / "a.json").read_text())
    for section in ("summary", "latency", "server", "client", "runs", "plots"):
        assert f'<section id="{section}">' in page, section
    # six plots of a sweep (the Pareto front one of them) plus the server's gauges
    assert page.count('src="data:image/png;base64,') == 7
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched from outside
    p50 = res["summary"]["ttft_ms"]["p50"]
    assert re.search(rf'data-key="summary.ttft_ms.p50">{p50:,.2f}<', page)


def test_explain_verdict_when_the_hardware_is_known(results):
    res = json.loads((results / "a.json").read_text())
    res["config"].update(model="smollm2-135m", hardware="h100")
    page = render_report(res)
    verdict = re.search(r'<section id="explain">.*?</section>', page).group(0)
    assert "On h100: <strong>" in verdict and "Next lever" in verdict
    assert "data-key=\"explain.decode.fraction_of_floor\"" in verdict
    res["config"]["hardware"] = None
    assert '<section id="explain">' not in render_report(res)


def test_comparison_marks_what_got_better_and_worse(results, capsys):
    a, b = (str(results / f"{n}.json") for n in "ab")
    assert cli_main(["bench", "--compare", a, b, "--html", str(results / "c.html")]) == 0
    out = capsys.readouterr().out
    assert "comparison against a" in out and "TTFT p50 (ms)" in out
    ra, rb = (json.loads((results / f"{n}.json").read_text()) for n in "ab")
    ttft = next(r for r in compare_rows([ra, rb]) if r["label"] == "TTFT p50 (ms)")
    assert ttft["verdict"][1] == "worse"  # b's fake server waits 60 ms, a's 20 ms
    page = (results / "c.html").read_text()
    changed = re.search(r'<section id="changed">.*?</section>', page).group(0)
    assert "extra_body" in changed and "60" in changed
    assert page.count('src="data:image/png;base64,') == 2
    assert render_comparison(["x", "y"], [ra, rb]).count('class="num worse"') >= 1


def test_compare_rejects_a_file_that_is_not_a_result(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert cli_main(["bench", "--compare", str(bad), str(bad)]) == 2
    assert "not a tokenmill bench result" in " ".join(capsys.readouterr().err.split())


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get "
                    "install -y chromium, as .ci/run does); the browser test needs it")
@pytest.mark.parametrize("page", ["a.html", "c.html"])
def test_the_report_renders_in_headless_chromium(results, page, tmp_path):
    if page == "c.html" and not (results / "c.html").exists():
        assert cli_main(["bench", "--compare", str(results / "a.json"),
                         str(results / "b.json"), "--html", str(results / "c.html")]) == 0
    url = (results / page).as_uri()
    flags = [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", url], capture_output=True, check=False,
                         text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    # every console message (errors, exceptions, logs) is logged with CONSOLE
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []
    html_text = (results / page).read_text()
    n_images = html_text.count("<img ")
    assert f'data-images-loaded="{n_images}"' in dom.stdout  # set by the page on load
    assert 'data-images-broken="0"' in dom.stdout
    res = json.loads((results / "a.json").read_text())
    if page == "a.html":
        assert '<figure id="plot-pareto">' in dom.stdout  # the sweep's front, rendered
        for key in ("output_throughput_tok_s", "request_throughput"):
            cell = re.search(rf'data-key="summary.{key}">([^<]+)<', dom.stdout).group(1)
            assert float(cell.replace(",", "")) == pytest.approx(res["summary"][key], rel=1e-3)
    else:
        assert re.search(r'data-key="summary.ttft_ms.p50" data-run="1">[0-9.,]+<', dom.stdout)
    shot = tmp_path / "shot.png"
    run = subprocess.run([CHROMIUM, *flags, "--window-size=1200,1600",
                          f"--screenshot={shot}", url], capture_output=True, text=True, check=False,
                         timeout=120)
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    assert _png_size(shot) == (1200, 1600)
    assert shot.stat().st_size > 30_000  # text, tables and plots, not a blank page


def test_offline_runs_show_the_engine_phases(results):
    res = json.loads((results / "a.json").read_text())
    res["engine"] = {"wall_time_s": 2.0, "num_steps": 40, "num_prefill_tokens": 128,
                     "num_decode_tokens": 256, "mean_decode_batch": 3.5,
                     "time_s": {"schedule": 0.1, "forward": 1.5}}
    section = re.search(r'<section id="engine">.*?</section>', render_report(res)).group(0)
    assert 'data-key="engine.time_s.forward">1.50<' in section and "75.0%" in section
