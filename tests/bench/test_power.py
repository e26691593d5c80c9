"""Cost from the machine's own power: RAPL counters (a planted powercap tree, wraparound
included), NVML where a GPU answers, and a clear reason where neither is readable."""

from pathlib import Path

import pytest

from tokenmill.bench.power import PowerMeter, RaplReader, power_label, power_summary


def plant_rapl(root: Path, energies: list[int], max_range: int = 2**32) -> None:
    for i, e in enumerate(energies):
        d = root / f"intel-rapl:{i}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "energy_uj").write_text(f"{e}\n")
        (d / "max_energy_range_uj").write_text(f"{max_range}\n")
        (d / "name").write_text(f"package-{i}\n")
    sub = root / "intel-rapl:0:0"  # a subzone (core): counted by its package already
    sub.mkdir(exist_ok=True)
    (sub / "energy_uj").write_text("999999999\n")


def test_rapl_energy_over_a_run_with_a_counter_wrap(tmp_path, monkeypatch):
    from tokenmill.bench import power

    monkeypatch.setattr(power.NvmlSampler, "available", property(lambda self: False))
    plant_rapl(tmp_path, [1_000_000, 2**32 - 500_000], max_range=2**32)
    meter = PowerMeter(powercap=tmp_path)
    assert meter.source == "rapl"
    meter.start()
    plant_rapl(tmp_path, [4_000_000, 1_500_000], max_range=2**32)  # the second wrapped
    p = power_summary(meter.stop(), output_tokens=500, price_per_kwh=0.36, same_host=True)
    assert p["energy_j"] == pytest.approx(3.0 + 2.0)
    assert p["domains"] == ["intel-rapl:0", "intel-rapl:1"]
    assert p["joules_per_output_token"] == pytest.approx(0.01)
    # 0.01 J a token: 1e4 J per 1M tokens = 1/360 kWh, at $0.36 a kWh
    assert p["energy_cost_per_1m_output_tokens"] == pytest.approx(0.001)
    assert "0.01 J per output token" in power_label(p)


def test_unreadable_power_says_why(tmp_path):
    assert "does not exist" in RaplReader(tmp_path / "none").why
    meter = PowerMeter(powercap=tmp_path / "none")
    if meter.source == "nvml":
        pytest.skip("this host has an NVIDIA GPU")
    meter.start()
    p = meter.stop()
    assert p["available"] is False and "RAPL" in p["why"] and "GPU" in p["why"]
    assert "--cost-per-hour" in power_label(p)


def test_bench_reports_power_beside_throughput(tmp_path, monkeypatch):
    import json

    from tests.bench.fakes import FakeServer
    from tokenmill.cli import main as cli_main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["a b c"] * 4))
    with FakeServer() as srv:
        out = tmp_path / "r.json"
        assert cli_main(["bench", "--base-url", srv.base_url, "--dataset", "jsonl",
                         "--dataset-path", str(prompts), "--output-len", "4",
                         "--num-requests", "4", "--no-progress", "--no-scrape",
                         "--price-per-kwh", "0.2", "--output", str(out),
                         "--html", str(tmp_path / "r.html")]) == 0
    p = json.loads(out.read_text())["summary"]["power"]
    assert p["available"] == (p["source"] is not None)
    if not p["available"]:  # a VM: says so
        assert "RAPL" in p["why"]
    else:
        assert p["joules_per_output_token"] > 0
    assert "<th>energy</th>" in (tmp_path / "r.html").read_text()
