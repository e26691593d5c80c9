"""`tokenmill roofline` and `tokenmill explain` through the real CLI entry point."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.cli import main

DATA = "tests/roofline/data"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_roofline_table_names_every_column(capsys):
    code, out, err = run(capsys, "roofline", "llama-3-8b", "--hardware", "h100")
    assert code == 0, err
    for column in ("batch", "bytes/step", "FLOP/byte", "bound", "TPOT floor", "tok/s total",
                   "$/1M out", "fits"):
        assert column in out
    assert "131,072 bytes/token" in out
    assert "16.06 GB" in out
    assert "TTFT floor" in out


def test_roofline_json_and_fleet(capsys):
    r = run_json(capsys, "roofline", "llama-3-8b", "--batch", "1,64", "--cost-per-hour", "2",
                 "--fleet-gpus", "1800", "--hours", "24")
    assert r["weight_bytes"] == 16_060_522_496
    assert r["kv_bytes_per_token"] == 131_072
    assert [row["batch"] for row in r["decode"]] == [1, 64]
    assert r["decode"][0]["bound"] == "memory"
    assert r["fleet"]["cost"] == 86_400
    assert r["max_batch"] > 64


def test_same_numbers_from_preset_config_and_gguf(capsys, smollm2_gguf):
    results = [run_json(capsys, "roofline", model, "--dtype", "bf16", "--batch", "1,16")
               for model in ("smollm2-135m", f"{DATA}/smollm2_config.json", smollm2_gguf)]
    for r in results:
        assert r["total_params"] == 134_515_008
        assert r["weight_bytes"] == results[0]["weight_bytes"]
        assert r["decode"] == results[0]["decode"]
    gguf = run_json(capsys, "roofline", smollm2_gguf)  # the file's own Q4_1/Q8_0 bytes
    assert gguf["weight_bytes"] == 96_576_768
    assert gguf["dtype"].startswith("gguf:")


def test_a_gguf_path_on_the_embedded_model_reads_its_file(capsys, smollm2_gguf):
    # `--quantization gguf-a16` (serve's default) on smollm2-135m runs the embedded file's
    # Q4_1 linears and Q8_0 embedding / LM head: 96.6 MB a step, not the preset's bf16 269
    for dtype in ("gguf", "gguf-a16"):
        r = run_json(capsys, "roofline", "smollm2-135m", "--dtype", dtype, "--batch", "1")
        assert r["weight_bytes"] == 96_576_768
        assert r["dtype"].startswith("gguf:")


def test_config_only_directory(capsys, tmp_path):
    (tmp_path / "config.json").write_bytes(Path(f"{DATA}/smollm2_config.json").read_bytes())
    assert run_json(capsys, "roofline", str(tmp_path))["total_params"] == 134_515_008


def test_hardware_cpu_from_cache(capsys, fake_cpu):
    r = run_json(capsys, "roofline", "smollm2-135m", "--hardware", "cpu", "--context", "1")
    assert r["hardware"]["memory_bandwidth_bytes_s"] == 47e9  # max(read 47, copy 44)
    assert r["hardware"]["peak_flops"]["bf16"] == 435e9
    # 269 MB of bf16 weights at 47 GB/s: ≈ 5.7 ms per batch-1 step (PERFORMANCE.md)
    assert r["decode"][0]["step_floor_ms"] == pytest.approx(5.7, abs=0.2)


def test_cpu_micro_benchmark_is_plausible_and_cached(cache_home, monkeypatch):
    from tokenmill.roofline import hardware

    calls = []
    real = hardware._micro_benchmark
    monkeypatch.setattr(hardware, "_micro_benchmark",
                        lambda torch: calls.append(1) or real(torch))
    # cached whatever its spread: a busy test machine's reads may well spread wide (the
    # steadiness rule is tested with fake measurements below)
    monkeypatch.setattr(hardware, "STEADY_SPREAD", float("inf"))
    hw = hardware.measure_cpu()
    assert calls == [1]
    assert 1e8 < hw.memory_bandwidth_bytes_s < 1e13
    for dtype in ("fp32", "bf16"):
        assert 1e8 < hw.flops(dtype) < 1e15
    from tokenmill.kernels import q4q8_gemv

    if q4q8_gemv.isa() in ("avx2", "avx512-vnni"):  # the engine's integer kernel, measured
        assert set(hw.measured["int_matmul_flops"]) == {"int8", "int16"}
        for rate in hw.measured["int_matmul_flops"].values():
            assert 1e8 < rate < 1e15
        assert hw.peak_dtype("int16") == "int16"
    assert hw.memory_bytes > 1e9
    assert hardware.cpu_cache_path().is_file()
    again = hardware.measure_cpu()
    assert calls == [1]  # the second call read the cache and measured nothing
    assert again.memory_bandwidth_bytes_s == hw.memory_bandwidth_bytes_s
    hardware.measure_cpu(refresh=True)
    assert calls == [1, 1]


def test_the_integer_rates_keep_the_faster_of_two_tries(monkeypatch):
    # measured before and after the bandwidth and matmul runs: a VM's slow second (int16
    # once read 111 GFLOP/s against ~220 a minute later) does not become the cached peak
    import torch

    from tokenmill.roofline import hardware

    tries = iter([({"int16": 111e9, "int8": 230e9}, "first"),
                  ({"int16": 220e9, "int8": 125e9}, "second")])
    monkeypatch.setattr(hardware, "_int_kernel_flops", lambda torch: next(tries))
    monkeypatch.setattr(hardware, "read_bandwidth_tries",
                        lambda torch: (torch.ones(1024), [1e9] * 5))
    monkeypatch.setattr(hardware, "_best_time", lambda fn, reps, budget_s=1.0: 1.0)
    figures = hardware._micro_benchmark(torch)
    assert figures["int_matmul_flops"] == {"int16": 220e9, "int8": 230e9}


def test_cpu_bf16_peak_is_never_below_fp32(plant_cpu, monkeypatch):
    # an AVX2 machine without native bf16: torch's bf16 matmul ran at 0.85 GFLOP/s, fp32 at
    # 119; an engine multiplies bf16 weights in fp32 there, so bf16's peak is fp32's
    from tokenmill.roofline import hardware

    monkeypatch.setattr(hardware, "_micro_benchmark", lambda torch: pytest.fail("measured"))
    plant_cpu({"read_bandwidth_bytes_s": 25e9,
               "matmul_flops": {"fp32": 119e9, "bf16": 0.85e9}})
    hw = hardware.measure_cpu()
    assert hw.flops("bf16") == 119e9 and hw.flops("fp32") == 119e9
    assert hw.measured["matmul_flops"]["bf16"] == 0.85e9  # the measurement itself is kept


def test_gguf_paths_are_held_against_the_peak_of_the_arithmetic_they_run(
        capsys, plant_cpu, monkeypatch):
    # the AVX2 EPYC: torch's fp32 matmul 119 GFLOP/s, its emulated bf16 0.85, while
    # `tokenmill serve`'s gguf-a16 multiplies int16 activations in its own kernel at ~220:
    # a compute floor at the fp32 rate overstates the floor and the MFU ~1.9x
    from tokenmill.roofline import hardware

    monkeypatch.setattr(hardware, "_micro_benchmark", lambda torch: pytest.fail("measured"))
    plant_cpu({"read_bandwidth_bytes_s": 30e9, "matmul_flops": {"fp32": 119e9, "bf16": 0.85e9},
                "int_matmul_flops": {"int16": 220e9, "int8": 250e9}})
    peaks = {}
    for dtype in ("gguf-a16", "gguf-a8", "gguf", "bf16"):
        r = run_json(capsys, "roofline", "smollm2-135m", "--dtype", dtype, "--hardware", "cpu",
                     "--batch", "64")
        peaks[dtype] = (r["hardware"]["compute_dtype"], r["ridge_intensity"] * 30e9)
    assert peaks["gguf-a16"] == ("int16", pytest.approx(220e9))
    assert peaks["gguf-a8"] == ("int8", pytest.approx(250e9))
    assert peaks["gguf"] == ("bf16", pytest.approx(119e9))  # bf16 activations: fp32 here
    assert peaks["bf16"] == ("bf16", pytest.approx(119e9))
    # a GPU's catalog has no int16 peak: the run is held against bf16's, and says so
    r = run_json(capsys, "roofline", "smollm2-135m", "--dtype", "gguf-a16", "--hardware", "h100")
    assert r["hardware"]["compute_dtype"] == "bf16"
    assert r["ridge_intensity"] == pytest.approx(989.5e12 / 3350e9)


def test_gguf_a8_holds_the_attention_linears_against_the_int16_peak_where_it_runs_them(
        plant_cpu, monkeypatch):
    # gguf-a8 multiplies the attention's qkv_proj and o_proj by int16 activations (the
    # accuracy gate's choice) except on Gemma 3, where every linear takes int8: the
    # floor holds that share of the FLOPs against int16's peak, not int8's
    from dataclasses import replace

    from tokenmill.roofline import hardware
    from tokenmill.roofline.arch import ModelArch, WeightBits
    from tokenmill.roofline.cost_model import decode_step, machine_for
    from tokenmill.roofline.inputs import load_model, weight_bits
    from tokenmill.roofline.source import ResolvedModel

    monkeypatch.setattr(hardware, "_micro_benchmark", lambda torch: pytest.fail("measured"))
    plant_cpu({"read_bandwidth_bytes_s": 30e9, "matmul_flops": {"fp32": 119e9, "bf16": 0.85e9},
               "int_matmul_flops": {"int16": 220e9, "int8": 250e9}})
    hw = hardware.get_hardware("cpu")
    model = load_model("smollm2-135m")
    bits = weight_bits(model, "gguf-a8")
    assert (bits.compute_dtype, bits.attention_compute_dtype) == ("int8", "int16")
    step = decode_step(model.arch, bits, machine_for(hw, 1, bits), 64, 512, 2.0)
    attention = 64 * 2.0 * model.arch.attention_linear_params_per_token()
    assert 0.1 < attention / step.flops < 0.3  # SmolLM2: ~20% of a step's FLOPs
    assert step.compute_time_s == pytest.approx((step.flops - attention) / 250e9
                                                + attention / 220e9)
    all_int8 = replace(bits, attention_compute_dtype=None)
    assert step.compute_time_s > decode_step(model.arch, all_int8, machine_for(hw, 1, all_int8),
                                             64, 512, 2.0).compute_time_s
    assert weight_bits(model, "gguf-a16").attention_compute_dtype is None  # int16 throughout
    config = {"vocab_size": 262144, "hidden_size": 640, "num_hidden_layers": 18,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
              "intermediate_size": 2048, "architectures": ["Gemma3ForCausalLM"]}
    gemma = ResolvedModel(ModelArch.from_config(config, "gemma"), WeightBits.from_name("q4_k"),
                          "gemma.gguf")
    assert weight_bits(gemma, "gguf-a8").attention_compute_dtype is None  # int8 throughout


def test_an_integer_kernel_slower_than_bf16_does_not_lower_the_peak(plant_cpu, monkeypatch):
    # an AVX512-BF16 CPU: gguf-a16 hands 20+ rows to the packed bf16 weights, so its peak
    # is bf16's where that is faster than the integer kernel
    from tokenmill.roofline import hardware

    monkeypatch.setattr(hardware, "_micro_benchmark", lambda torch: pytest.fail("measured"))
    plant_cpu({"read_bandwidth_bytes_s": 47e9, "matmul_flops": {"fp32": 215e9, "bf16": 435e9},
                "int_matmul_flops": {"int16": 300e9, "int8": 600e9}})
    hw = hardware.measure_cpu()
    assert hw.flops("int16") == 435e9 and hw.flops("int8") == 600e9
    assert hw.measured["int_matmul_flops"]["int16"] == 300e9  # the measurement itself is kept


def test_cpu_figures_come_from_the_cache_file(cache_home, monkeypatch):
    import torch

    from tokenmill.roofline import hardware

    monkeypatch.setattr(hardware, "_micro_benchmark", lambda torch: pytest.fail("measured"))
    planted = {"read_bandwidth_bytes_s": 12e9, "copy_bandwidth_bytes_s": 30e9,
               "matmul_flops": {"fp32": 1e11, "bf16": 3e11}}
    path = hardware.cpu_cache_path()
    path.parent.mkdir(parents=True)
    key = hardware.cpu_cache_key(torch.get_num_threads(), torch.__version__)
    path.write_text(json.dumps({key: planted, "other-cpu|threads=1|torch=0": {}}))
    hw = hardware.measure_cpu()
    assert hw.memory_bandwidth_bytes_s == 12e9  # the median read (issue 22: not flattered by copy)
    assert hw.flops("bf16") == 3e11 and hw.flops("fp32") == 1e11


def test_overrides(capsys):
    r = run_json(capsys, "roofline", "llama-3-8b", "--bandwidth", "1000", "--flops", "100",
                 "--batch", "1")
    assert r["hardware"]["memory_bandwidth_bytes_s"] == 1e12
    assert r["hardware"]["peak_flops"]["bf16"] == 100e12


def test_plot_writes_png(capsys, tmp_path):
    path = tmp_path / "roofline.png"
    code, _out, err = run(capsys, "roofline", "mixtral-8x7b", "--plot", str(path))
    assert code == 0, err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_explain_bench_result(capsys, fake_cpu):
    code, out, err = run(capsys, "explain", f"{DATA}/bench_result.json")
    assert code == 0, err
    assert "Bottleneck:" in out and "Next lever:" in out
    r = run_json(capsys, "explain", f"{DATA}/bench_result.json")
    d = r["decode"]
    assert d["batch"] == 15.6
    assert d["measured_step_ms"] == 51.0
    assert 0 < d["bandwidth_fraction"] <= 1
    assert d["achieved_bandwidth_bytes_s"] == pytest.approx(d["bytes_per_step"] / 0.051)
    assert 0 < r["prefill"]["mfu"] < 1
    assert r["bottleneck"]
    assert r["next_lever"]["name"] and r["next_lever"]["why"]
    # ITL p99 410 ms vs p50 41 ms: long prefills stall decodes; tokenmill always chunks,
    # so the lever is smaller chunks (issue 22), not turning chunking on
    assert any(lever["name"].startswith("smaller prefill chunks") for lever in r["levers"])
    # issue 62: the other lever against prefill interference, with its flag
    pd = next(lever for lever in r["levers"] if lever["name"] == "prefill/decode disaggregation")
    assert "--kv-transfer-config" in pd["flags"][0] and "ITL p99 410 ms" in pd["why"]


def test_explain_offline_result_with_engine_split(capsys, fake_cpu, tmp_path):
    r = run_json(capsys, "explain", f"{DATA}/offline_result.json", "--plot",
                 str(tmp_path / "e.png"))
    e = r["engine"]
    assert e["overhead_share"] == pytest.approx((3.1 + 9.8 + 14.4 + 4.2) / 101.5)
    assert e["forward_share"] == pytest.approx(70.0 / 101.5)
    assert 0 < e["bandwidth_fraction"] and 0 < e["mfu"] < 1
    assert r["bottleneck"].startswith("host overhead")
    assert "sampl" in r["next_lever"]["name"]
    assert (tmp_path / "e.png").is_file()


def test_explain_degrades_with_few_fields(capsys, fake_cpu, tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"config": {"model": "smollm2-135m"},
                                "summary": {"output_throughput_tok_s": 150.0,
                                            "mean_in_flight": 1}}))
    r = run_json(capsys, "explain", str(path), "--hardware", "cpu")
    assert r["decode"]["measured_step_ms"] == pytest.approx(1000 / 150)
    assert r["prefill"] is None and r["engine"] is None
    assert r["bottleneck"]


def test_explain_holds_against_catalog_hardware(capsys):
    r = run_json(capsys, "explain", f"{DATA}/bench_result.json", "--hardware", "h100")
    assert r["hardware"] == "h100"
    assert r["decode"]["bandwidth_fraction"] < 0.01  # a CPU-speed run against an H100


@pytest.mark.parametrize("argv, expected", [
    (["roofline", "llama-9"], "llama-3-8b"),
    (["roofline", "llama-3-8b", "--hardware", "tpu9"], "h100-sxm"),
    (["roofline", "llama-3-8b", "--batch", "0"], "--batch"),
    (["roofline", "llama-3-8b", "--batch", "one"], "--batch"),
    (["roofline", "llama-3-8b", "--prompt-len", "-5"], "--prompt-len"),
    (["roofline", "llama-3-8b", "--context", "-1"], "--context"),
    (["roofline", "llama-3-8b", "--num-gpus", "0"], "--num-gpus"),
    (["roofline", "llama-3-8b", "--dtype", "q9_z"], "q4_1"),
    (["roofline", "llama-3-8b", "--dtype", "gguf-a16"], "not a GGUF file"),
    (["roofline", "llama-3-8b", "--bandwidth", "-3"], "--bandwidth"),
    (["roofline", "does/not/exist.gguf"], "does not exist"),
    (["explain", "no-such-result.json"], "cannot read"),
    (["explain", f"{DATA}/smollm2_config.json"], "config.model"),
    (["explain", f"{DATA}/bench_result.json", "--hardware", "tpu9"], "h100-sxm"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, expected):
    code, _out, err = run(capsys, *argv)
    assert code == 2
    assert expected in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_command_module_imports_light():
    code = ("import sys, tokenmill.cli.roofline; "
            "bad = [m for m in ('torch', 'matplotlib', 'gguf') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("recorded, expected", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA L40S", "l40s"), ("NVIDIA L4", "l4"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("cpu", "cpu"),
])
def test_explain_maps_recorded_device_names(recorded, expected):
    import argparse

    from tokenmill.roofline.explain import _hardware_name

    args = argparse.Namespace(hardware=None)
    assert _hardware_name(args, {"hardware": recorded}, []) == expected
