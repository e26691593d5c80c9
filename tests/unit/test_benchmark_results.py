"""benchmarks/results.py and report.py: results as data, BENCHMARKS.md generated from them.

The fixtures (tests/data/benchmark_results/) are two real smoke runs of
`python -m benchmarks run w3 / w4 --peers llama` at tiny sizes (their figures are
noise): the W4 one is the Gemma 3 file that tokenmill refuses, beside llama-bench."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import readme_numbers, report, results
from benchmarks.results import Figure, ResultError, machine_class

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "benchmark_results"


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    shutil.copytree(FIXTURES, folder)
    readme = tmp_path / "README.md"  # report also writes README's table: never the real one here
    readme.write_text(f"# x\n\n{readme_numbers.START}\n{readme_numbers.END}\n\ntail\n")
    return folder


def _args(folder: Path, out: Path, *more: str) -> list[str]:
    return ["--results", str(folder), "--output", str(out),
            "--readme", str(folder.parent / "README.md"), *more]


def test_report_regenerates_the_same_page_from_the_same_results(tmp_path):
    folder = _folder(tmp_path)
    out = tmp_path / "BENCHMARKS.md"
    assert report.main(_args(folder, out)) == 0
    first = out.read_bytes()
    assert report.main(_args(folder, out)) == 0
    assert out.read_bytes() == first
    assert report.main(_args(folder, out, "--check")) == 0
    page = first.decode()
    # per workload, per machine class; the command, the commit and the ratios of that run
    assert page.index("## W3 single-stream decode") < page.index("## W4 prefill")
    assert "### avx512-vnni" in page
    w3 = json.loads((folder / "2026-12-06-avx512-vnni-w3.json").read_text())
    assert f"    {w3['command']}" in page and f"`{w3['commit']}`" in page
    ratio = w3["ratios"][0]
    assert f"{ratio['tokenmill']} vs {ratio['peer']}: **{ratio['ratio']:.2f}x**" in page
    assert "tokenmill does not support" in page  # the refusal is shown, not dropped


def test_readme_carries_one_generated_table_of_the_latest_headlines(tmp_path):
    folder = _folder(tmp_path)
    out, readme = tmp_path / "BENCHMARKS.md", tmp_path / "README.md"
    assert report.main(_args(folder, out)) == 0
    text = readme.read_text()
    assert text.startswith("# x\n") and text.endswith("\ntail\n")  # only between the markers
    table = text.split(readme_numbers.START)[1].split(readme_numbers.END)[0]
    w3 = json.loads((folder / "2026-12-06-avx512-vnni-w3.json").read_text())
    ratio = w3["ratios"][0]
    row = next(line for line in table.splitlines() if w3["title"] in line)
    assert f"**{ratio['ratio']:.2f}x**" in row and ratio["peer"] in row and w3["commit"] in row
    assert f"**{w3['machine']['class']}** = {w3['machine']['cpu']}" in table  # the machine named
    assert report.main(_args(folder, out, "--check")) == 0
    # a hand edit inside the table is stale; so is a README without the markers
    readme.write_text(text.replace(f"**{ratio['ratio']:.2f}x**", "**9.99x**"))
    assert report.main(_args(folder, out, "--check")) == 1
    readme.write_text("# no markers\n")
    assert report.main(_args(folder, out)) == 1


def test_the_repository_readme_table_is_current():
    """README.md's table is what the committed results give (as `make lint` checks)."""
    root = Path(__file__).resolve().parents[2]
    assert report.main(["--check", "--output", str(root / "BENCHMARKS.md"),
                        "--readme", str(root / "README.md")]) == 0


def test_check_fails_on_a_stale_page(tmp_path):
    folder = _folder(tmp_path)
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\nhand-edited\n")
    assert report.main(_args(folder, out, "--check")) == 1


def test_the_latest_result_of_a_name_and_class_is_the_one_shown(tmp_path):
    folder = _folder(tmp_path)
    w3 = json.loads((folder / "2026-12-06-avx512-vnni-w3.json").read_text())
    later = copy.deepcopy(w3)
    later["date"] = "2026-12-07T01:00:00Z"
    later["commit"] = "fedcba9"
    results.write(later, folder)
    other_class = copy.deepcopy(w3)
    other_class["machine"]["class"] = "avx2"
    other_class["commit"] = "0a1b2c3"
    results.write(other_class, folder)
    page = report.render(results.load_all(folder))
    assert "`fedcba9`" in page and f"`{w3['commit']}`, " not in page.split("## W4")[0]
    assert "### avx2" in page and "`0a1b2c3`" in page


def test_no_results_gives_a_page_saying_so(tmp_path):
    page = report.render(results.load_all(tmp_path))
    assert "No results yet" in page and "python -m benchmarks run w3" in page


@pytest.mark.parametrize("drop, named", [
    (("machine", "class"), "missing required field 'machine.class'"),
    (("commit",), "missing required field 'commit'"),
    (("figures", 0, "median"), "figures[0] missing required field 'median'"),
])
def test_a_result_missing_a_required_field_is_refused_by_name(tmp_path, drop, named):
    folder = _folder(tmp_path)
    path = folder / "2026-12-06-avx512-vnni-w3.json"
    data = json.loads(path.read_text())
    node = data
    for key in drop[:-1]:
        node = node[key]
    del node[drop[-1]]
    path.write_text(json.dumps(data))
    pattern = re.escape(f"{path.name}: ") + ".*" + re.escape(named)
    with pytest.raises(ResultError, match=pattern):
        results.load(path)
    assert report.main(_args(folder, tmp_path / "B.md")) == 1
    assert not (tmp_path / "B.md").exists()
    with pytest.raises(ResultError, match="missing required field"):
        results.write(data, tmp_path / "out")


@pytest.mark.parametrize("flags, gpu, cls", [
    ({"avx2", "fma"}, None, "avx2"),
    ({"avx2", "avx512f"}, None, "avx512"),
    ({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, None, "avx512-vnni"),
    ({"avx2"}, "NVIDIA H100 80GB HBM3", "gpu-h100"),
    ({"avx2"}, "NVIDIA H200", "gpu-h200"),
])
def test_machine_class_from_the_flags(flags, gpu, cls):
    assert machine_class(flags, gpu) == cls


def test_a_built_result_has_the_ratios_of_its_run_each_way_up(tmp_path):
    figures = [Figure("tokenmill default", "tokenmill", "decode", "tok/s", [300, 290, 310],
                      True, {"model": "m.gguf"}),
               Figure("tokenmill default", "tokenmill", "peak RSS", "MiB", [500], False),
               Figure("llama.cpp tg128", "llama.cpp", "decode", "tok/s", [150, 140], True),
               Figure("llama.cpp tg128", "llama.cpp", "peak RSS", "MiB", [250], False)]
    r = results.build("w3", "W3 single-stream decode", figures, variant="SmolLM2.Q4_K_M",
                      command="python -m benchmarks run w3 --peers llama")
    assert r["name"] == "w3-smollm2.q4_k_m"
    assert {(x["metric"], x["ratio"]) for x in r["ratios"]} == {
        ("decode", round(300 / 145, 4)), ("peak RSS", 0.5)}  # lower RSS is better
    fig = r["figures"][0]
    assert (fig["median"], fig["min"], fig["max"], fig["runs"]) == (300, 290, 310,
                                                                     [300, 290, 310])
    path = results.write(r, tmp_path)
    assert path.name == f"{r['date'][:10]}-{r['machine']['class']}-w3-smollm2.q4_k_m.json"
    assert results.load(path) == r
    with pytest.raises(ResultError, match="engine 'llama' is not one of"):
        results.build("w3", "W3", [Figure("x", "llama", "decode", "tok/s", [1.0], True)])


def test_pareto_plot_lands_beside_its_result_and_report_still_reads_the_folder(tmp_path):
    """W2's sweep plot (every server's Pareto front) is a PNG named after the result file;
    the report reads only the JSON beside it."""
    from tokenmill.bench.pareto import pareto_figure, pareto_section

    def run(c: int, tok_s: float, tpot: float) -> dict:
        return {"config": {"concurrency": c}, "summary": {
            "output_throughput_tok_s": tok_s, "tpot_ms": {"mean": tpot, "p50": tpot},
            "num_completed": 8, "num_failed": 0}}

    sweeps = {name: {"pareto": pareto_section(
        [run(1, k * 100, 10 / k), run(4, k * 300, 13 / k), run(16, k * 450, 35 / k)],
        "concurrency")} for name, k in (("tokenmill", 1.0), ("vLLM (both cores)", 0.5))}
    result = results.build("w2", "W2", [Figure("tokenmill", "tokenmill", "m", "tok/s", [1.0],
                                               True, {})])
    folder = _folder(tmp_path)
    plot = results.write_plot(result, "pareto", lambda plt: pareto_figure(
        plt, list(sweeps.values()), list(sweeps)), results_dir=folder)
    png = folder / results.file_name(result).replace(".json", ".pareto.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and Path(plot).name == png.name
    assert report.main(_args(folder, tmp_path / "BENCHMARKS.md")) == 0


def test_the_front_page_shows_the_newest_run_on_each_model(tmp_path):
    """README's table: of two names on one file (two configurations, or a default that
    changed) the newer run's headline, once; another file keeps its own row."""
    folder = _folder(tmp_path)
    w3 = json.loads((folder / "2026-12-06-avx512-vnni-w3.json").read_text())
    newer = copy.deepcopy(w3)
    newer["name"], newer["date"], newer["commit"] = "w3-other-config", "2026-12-07T02:00:00Z", \
        "abcdef1"
    results.write(newer, folder)
    other_model = copy.deepcopy(w3)
    other_model["name"], other_model["commit"] = "w3-other-file", "1234567"
    for f in other_model["figures"]:
        f["config"]["model"] = "other.gguf"
    results.write(other_model, folder)
    latest = report.latest_results(results.load_all(folder))
    table = readme_numbers.render(latest)
    rows = [line for line in table.splitlines() if w3["title"] in line]
    assert len(rows) == 2
    assert any("abcdef1" in r for r in rows) and any("1234567" in r for r in rows)
    assert not any(f"`{w3['commit']}`" in r for r in rows)  # the older run on that file
    page = report.render(results.load_all(folder))  # BENCHMARKS.md keeps every name
    assert f"`{w3['commit']}`" in page and "`abcdef1`" in page
