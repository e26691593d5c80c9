"""Only a steady CPU measurement is cached (roofline/hardware.py STEADY_SPREAD).

A measurement taken while other work ran (read tries 5.2-13.3 GB/s where a quiet run
gives 29.5-30.4) was cached and made `tokenmill explain` call a step "135% of its
floor" for days. Now such a measurement is taken again a bounded number of times,
used for the run only if it stays unsteady, and labelled wherever a CPU figure is
printed; `--remeasure` takes it again on request. Fake measurements: no timing here.
"""

from __future__ import annotations

import itertools
import json

import pytest

from tests.roofline.test_cli import DATA, run, run_json
from tokenmill.roofline import hardware

GB = 1e9
LOADED = [5.2e9, 6.8e9, 9.1e9, 11.0e9, 13.3e9]  # the tries the stale cache held
QUIET = [29.5e9, 29.7e9, 29.8e9, 30.3e9, 30.4e9]


def _figures(tries: list[float]) -> dict:
    return {"read_bandwidth_bytes_s": sorted(tries)[2],
            "read_bandwidth_tries_bytes_s": sorted(tries), "buffer_bytes": 256 * 2**20,
            "copy_bandwidth_bytes_s": 20e9, "matmul_flops": {"fp32": 215e9, "bf16": 435e9},
            "measured_at": "2026-12-06T05:30:00"}


@pytest.fixture
def measure(cache_home, monkeypatch):
    """measure(first tries, *retakes): fake the micro-benchmark and the read retakes;
    returns the calls made, as a list of "all" / "reads"."""
    calls: list[str] = []
    monkeypatch.setattr(hardware, "READ_PAUSE_S", 0.0)

    def plant(first: list[float], *retakes: list[float]) -> list[str]:
        more = itertools.cycle(retakes or [first])  # the next run retakes them again
        monkeypatch.setattr(hardware, "_micro_benchmark",
                            lambda torch: calls.append("all") or _figures(first))
        monkeypatch.setattr(hardware, "read_bandwidth_tries",
                            lambda torch: calls.append("reads") or (None, next(more)))
        return calls
    return plant


def _cached() -> dict:
    path = hardware.cpu_cache_path()
    return json.loads(path.read_text()) if path.exists() else {}


def test_a_measurement_under_load_is_not_cached_and_says_so(measure, capsys):
    calls = measure(LOADED, [4.0e9, 9.0e9] * 2 + [6e9], [6.0e9, 7.0e9, 8.0e9, 9.0e9, 12.0e9])
    hw = hardware.measure_cpu()
    assert calls == ["all", "reads", "reads"]  # READ_ATTEMPTS in all, no more
    assert not any(_cached().values())  # nothing cached for this machine
    assert hw.measured["under_load"]
    assert hw.memory_bandwidth_bytes_s == 13.3e9  # the best read of the attempts, this run
    basis = hardware.bandwidth_basis(hw)
    assert basis.startswith("measured under load: tries spread 5.2–13.3 GB/s; not cached")
    assert "measured 2026-12-06 05:30" in basis and "--remeasure" in basis
    assert "not cached" in hw.source
    # the next run measures again, and the output of both commands says what it is
    code, out, err = run(capsys, "roofline", "smollm2-135m", "--hardware", "cpu",
                         "--batch", "1")
    assert code == 0, err
    assert "measured under load: tries spread" in out.replace("\n", " ")
    assert calls == ["all", "reads", "reads"] * 2
    code, out, err = run(capsys, "explain", f"{DATA}/bench_result.json", "--hardware", "cpu")
    assert code == 0, err
    assert "measured under load: tries spread" in out.replace("\n", " ")


def test_a_steady_measurement_is_cached_with_its_date_and_spread(measure, capsys):
    calls = measure(QUIET)
    hw = hardware.measure_cpu()
    assert calls == ["all"] and "under_load" not in hw.measured
    assert list(_cached().values()) == [hw.measured]
    again = hardware.measure_cpu()
    assert calls == ["all"] and again.measured == hw.measured  # read from the cache
    assert hardware.bandwidth_basis(again) == ("best of 5 streaming reads of 256 MiB, spread "
                                               "29.5–30.4 GB/s, measured 2026-12-06 05:30")
    r = run_json(capsys, "roofline", "smollm2-135m", "--hardware", "cpu", "--batch", "1")
    assert r["hardware"]["bandwidth_basis"].endswith("measured 2026-12-06 05:30")


def test_a_steady_retake_is_cached_in_place_of_the_loaded_reads(measure):
    calls = measure(LOADED, QUIET)
    hw = hardware.measure_cpu()
    assert calls == ["all", "reads"]
    assert hw.memory_bandwidth_bytes_s == 30.4e9
    assert hw.measured["read_attempts_gb_s"] == [[5.2, 13.3], [29.5, 30.4]]
    assert list(_cached().values()) == [hw.measured]


def test_an_unsteady_cached_entry_and_remeasure_measure_again(measure, plant_cpu, capsys):
    calls = measure(QUIET)
    plant_cpu(_figures(LOADED))  # cached before the rule existed
    assert hardware.measure_cpu().memory_bandwidth_bytes_s == 30.4e9
    assert calls == ["all"]
    run_json(capsys, "roofline", "smollm2-135m", "--hardware", "cpu", "--batch", "1")
    assert calls == ["all"]  # cached now
    run_json(capsys, "roofline", "smollm2-135m", "--hardware", "cpu", "--batch", "1",
             "--remeasure")
    assert calls == ["all", "all"]
    code, _, err = run(capsys, "roofline", "smollm2-135m", "--hardware", "h100",
                       "--remeasure")
    assert code == 2 and "--remeasure" in err and "h100" in err
