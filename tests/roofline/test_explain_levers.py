"""Issue 22: every lever explain names is a flag `tokenmill serve` accepts, levers the run
already pulled are not recommended, and the floor says which bandwidth figure it used."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.cli import build_parser, main

DATA = Path(__file__).parent / "data"


def _explain_json(capsys, path, *extra):
    code = main(["explain", str(path), *extra, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def _write(tmp_path, name, config, summary, engine=None):
    path = tmp_path / name
    body = {"config": config, "summary": summary}
    if engine:
        body["engine"] = engine
    path.write_text(json.dumps(body))
    return path


def _stat(mean, p50=None, p99=None):
    return {"mean": mean, "p50": p50 or mean, "p99": p99 or mean}


@pytest.fixture
def results(tmp_path):
    """Results that between them reach every lever explain has."""
    w2 = json.loads((DATA / "bench_result.json").read_text())
    w2["summary"]["itl_ms"] = _stat(40, 30, 400)  # a stalled p99: the chunked-prefill lever
    w2_path = tmp_path / "w2.json"
    w2_path.write_text(json.dumps(w2))
    return [
        (DATA / "bench_result.json", []),
        (DATA / "offline_result.json", []),
        (w2_path, []),
        # long contexts at batch 64 on a GPU: KV reads dominate
        (_write(tmp_path, "long.json", {"model": "llama-3-8b", "dtype": "bf16"},
                {"mean_in_flight": 64, "mean_input_tokens": 2048, "mean_output_tokens": 256,
                 "tpot_ms": _stat(12.0), "ttft_ms": _stat(300.0)}), ["--hardware", "h100"]),
        # batch 1, near the floor: speculative decoding and int8 weights
        (_write(tmp_path, "b1.json", {"model": "llama-3-8b", "dtype": "bf16"},
                {"mean_in_flight": 1, "mean_input_tokens": 128, "mean_output_tokens": 256,
                 "tpot_ms": _stat(6.0), "ttft_ms": _stat(30.0)}), ["--hardware", "h100"]),
        # far from the floor: overhead-bound
        (_write(tmp_path, "slow.json", {"model": "llama-3-8b", "dtype": "bf16"},
                {"mean_in_flight": 2, "mean_input_tokens": 128, "mean_output_tokens": 256,
                 "tpot_ms": _stat(60.0), "ttft_ms": _stat(30.0)}), ["--hardware", "h100"]),
        # past the ridge: compute-bound
        (_write(tmp_path, "big.json", {"model": "llama-3-8b", "dtype": "bf16"},
                {"mean_in_flight": 1024, "mean_input_tokens": 64, "mean_output_tokens": 64,
                 "tpot_ms": _stat(200.0)}), ["--hardware", "h100"]),
    ]


def _serve_help_flags() -> set[str]:
    """The flags the real CLI prints for `tokenmill serve --help`."""
    help_text = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--help"],
                               capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", help_text))


def test_every_lever_names_a_flag_serve_accepts(capsys, fake_cpu, results):
    accepted = _serve_help_flags()
    assert "--kv-cache-dtype" in accepted
    named = set()
    seen_levers = set()
    for path, extra in results:
        r = _explain_json(capsys, path, *extra)
        for lever in r["levers"]:
            seen_levers.add(lever["name"].split(" (")[0])
            assert lever["flags"] or lever["instead"], lever  # a flag, or why there is none
            for flags in lever["flags"]:
                argv = shlex.split(flags)
                for token in argv:
                    if token.startswith("--"):
                        assert token in accepted, (token, lever["name"])
                        named.add(token)
                # and with its values: the real parser takes them
                build_parser(["serve"]).parse_args(["serve", *argv])
    # the levers this issue is about were reached, each with its flag
    assert {"--kv-cache-dtype", "--speculative", "--num-speculative-tokens", "--max-num-seqs",
            "--quantization", "--max-num-batched-tokens"} <= named, named
    assert "int8 weights" in seen_levers


def test_text_lever_lines_end_with_the_flag(capsys, fake_cpu, tmp_path):
    path = _write(tmp_path, "long.json", {"model": "llama-3-8b", "dtype": "bf16"},
                  {"mean_in_flight": 64, "mean_input_tokens": 2048, "mean_output_tokens": 256,
                   "tpot_ms": _stat(12.0)})
    assert main(["explain", str(path), "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    lever_lines = [line for line in out.splitlines()
                   if line.startswith(("Next lever:", "  then:"))]
    assert lever_lines
    for line in lever_lines:
        assert re.search(r"(try: --\S.*|no serving flag: .+)$", line), line
    assert "try: --kv-cache-dtype fp8" in out


def test_cpu_kv_lever_is_int8(capsys, fake_cpu, tmp_path):
    path = _write(tmp_path, "cpu_long.json", {"model": "smollm2-135m", "hardware": "cpu"},
                  {"mean_in_flight": 32, "mean_input_tokens": 2048, "mean_output_tokens": 256,
                   "tpot_ms": _stat(1000 * 32 * 2048 * 30 * 2 * 3 * 64 * 2 / 47e9 * 1.2)})
    levers = _explain_json(capsys, path)["levers"]
    kv = [lever for lever in levers if "KV cache" in lever["name"]]
    assert kv and kv[0]["flags"] == ["--kv-cache-dtype int8"]


def test_kv_lever_not_repeated_when_kv_is_already_8_bit(capsys, fake_cpu, tmp_path):
    summary = {"mean_in_flight": 64, "mean_input_tokens": 2048, "mean_output_tokens": 256,
               "tpot_ms": _stat(12.0)}
    bf16 = _write(tmp_path, "a.json", {"model": "llama-3-8b"}, summary)
    fp8 = _write(tmp_path, "b.json", {"model": "llama-3-8b", "server_config": {
        "engine": "tokenmill", "kv_cache_dtype": "fp8"}}, summary)
    a = _explain_json(capsys, bf16, "--hardware", "h100")
    b = _explain_json(capsys, fp8, "--hardware", "h100")
    assert any("KV cache" in lever["name"] for lever in a["levers"])
    assert not any("KV cache" in lever["name"] for lever in b["levers"])
    # the roofline counts KV bytes at the run's KV dtype: half of them
    assert b["decode"]["kv_bytes_per_step"] == pytest.approx(a["decode"]["kv_bytes_per_step"] / 2)


def test_explain_holds_a_run_against_the_weights_the_server_ran(capsys, fake_cpu, plant_cpu,
                                                               tmp_path):
    # a default `tokenmill serve` records quantization gguf-a16 (dtype bfloat16) on
    # smollm2-135m: its floor is the embedded Q4_1 file's 96.6 MB a step, not bf16's 269 MB
    summary = {"mean_in_flight": 1, "mean_input_tokens": 128, "mean_output_tokens": 128,
               "tpot_ms": _stat(5.0), "ttft_ms": _stat(150.0)}
    served = {"engine": "tokenmill", "model": "smollm2-135m", "dtype": "bfloat16",
              "quantization": "gguf-a16", "kv_cache_dtype": "auto"}
    q4 = _explain_json(capsys, _write(tmp_path, "q4.json", {
        "model": "smollm2-135m", "hardware": "cpu", "server_config": served}, summary))
    bf16 = _explain_json(capsys, _write(tmp_path, "bf16.json", {
        "model": "smollm2-135m", "hardware": "cpu",
        "server_config": {**served, "quantization": "none"}}, summary))
    assert q4["dtype"].startswith("gguf:") and bf16["dtype"] == "bf16"
    assert q4["decode"]["weight_bytes_per_step"] == 96_576_768
    assert bf16["decode"]["weight_bytes_per_step"] > 2.5 * 96_576_768
    # without a measured integer kernel the int16 activations read bf16's peak, and say so
    assert q4["compute_dtype"] == bf16["compute_dtype"] == "bf16"
    # with one, they are held against the int16 peak (the bf16 weights still bf16's)
    plant_cpu({**fake_cpu, "int_matmul_flops": {"int16": 600e9, "int8": 900e9}})
    q4 = _explain_json(capsys, tmp_path / "q4.json")
    bf16 = _explain_json(capsys, tmp_path / "bf16.json")
    assert (q4["compute_dtype"], q4["peak_flops"]) == ("int16", 600e9)
    assert (bf16["compute_dtype"], bf16["peak_flops"]) == ("bf16", 435e9)


def test_explain_holds_a_llama_server_run_against_the_file_it_ran(capsys, fake_cpu, plant_cpu,
                                                                  smollm2_gguf, tmp_path):
    # a llama-server run whose client named the model by its config (a bf16 checkpoint's
    # directory): /props names the GGUF file the server ran, and llama.cpp multiplies its
    # Q4_1 blocks by 8-bit activations (tokenmill's gguf-a8)
    plant_cpu({**fake_cpu, "int_matmul_flops": {"int16": 600e9, "int8": 900e9}})
    checkpoint = tmp_path / "smollm2"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_bytes((DATA / "smollm2_config.json").read_bytes())
    summary = {"mean_in_flight": 16, "mean_input_tokens": 128, "mean_output_tokens": 128,
               "tpot_ms": _stat(100.0), "ttft_ms": _stat(900.0)}
    served = {"engine": "llama.cpp", "model": smollm2_gguf, "quantization": "gguf-a8",
              "max_num_seqs": 16}
    r = _explain_json(capsys, _write(tmp_path, "llama.json", {
        "model": str(checkpoint), "hardware": "cpu", "server_config": served}, summary))
    assert r["dtype"].startswith("gguf:") and r["compute_dtype"] == "int8"
    assert r["decode"]["weight_bytes_per_step"] == 96_576_768
    assert r["peak_flops"] == 900e9
    # 28 requests in flight at concurrency 32 against its 16 slots: 16 decode at a time
    r = _explain_json(capsys, _write(tmp_path, "llama32.json", {
        "model": str(checkpoint), "hardware": "cpu", "server_config": served},
        {**summary, "mean_in_flight": 28.1}))
    assert r["decode"]["batch"] == 16


def test_chunked_prefill_on_is_not_recommended(capsys, fake_cpu, tmp_path):
    result = json.loads((DATA / "bench_result.json").read_text())
    result["summary"]["itl_ms"] = _stat(40, 30, 400)
    result["config"]["server_config"] = {
        "engine": "tokenmill", "enable_chunked_prefill": True, "max_num_batched_tokens": 1024,
        "enable_prefix_caching": True, "max_num_seqs": 64}
    path = tmp_path / "w2_with_config.json"
    path.write_text(json.dumps(result))
    r = _explain_json(capsys, path)
    names = [lever["name"] for lever in r["levers"]]
    assert not any(name.startswith("chunked prefill") for name in names), names
    assert not any(name.startswith("prefix caching") for name in names), names
    chunks = [lever for lever in r["levers"] if lever["name"].startswith("smaller prefill")]
    assert chunks and chunks[0]["flags"] == ["--max-num-batched-tokens 512"]
    assert "chunked prefill is on" in chunks[0]["name"]


def test_bigger_batch_when_the_server_already_admits_it(capsys, fake_cpu, tmp_path):
    summary = {"mean_in_flight": 2, "mean_input_tokens": 128, "mean_output_tokens": 256,
               "tpot_ms": _stat(6.0)}
    path = _write(tmp_path, "b.json", {"model": "llama-3-8b", "server_config": {
        "engine": "tokenmill", "max_num_seqs": 256}}, summary)
    r = _explain_json(capsys, path, "--hardware", "h100")
    batch = [lever for lever in r["levers"] if lever["name"].startswith("bigger batch")]
    assert batch and not batch[0]["flags"] and "--concurrency" in batch[0]["instead"]


def test_explain_says_which_bandwidth_the_floor_used(capsys, cache_home, tmp_path):
    import torch

    from tokenmill.roofline import hardware

    figures = {"read_bandwidth_bytes_s": 50e9, "copy_bandwidth_bytes_s": 44e9,
               "read_bandwidth_tries_bytes_s": [49e9, 50e9, 50e9, 52e9, 60e9],
               "buffer_bytes": 256 * 2**20, "matmul_flops": {"fp32": 215e9, "bf16": 435e9},
               "measured_at": "2026-12-06T11:48:05"}
    path = hardware.cpu_cache_path()
    path.parent.mkdir(parents=True)
    key = hardware.cpu_cache_key(torch.get_num_threads(), torch.__version__)
    path.write_text(json.dumps({key: figures}))
    r = _explain_json(capsys, DATA / "bench_result.json")
    assert r["memory_bandwidth_bytes_s"] == 60e9  # the best try: a floor is a bound
    assert r["bandwidth_basis"] == ("best of 5 streaming reads of 256 MiB, spread "
                                    "49.0–60.0 GB/s, measured 2026-12-06 11:48")
    assert main(["explain", str(DATA / "bench_result.json")]) == 0
    assert "best of 5 streaming reads" in capsys.readouterr().out
    r = _explain_json(capsys, DATA / "bench_result.json", "--bandwidth", "30")
    assert r["bandwidth_basis"] == "--bandwidth"


def test_cpu_bandwidth_buffer_is_past_the_last_level_cache():
    import torch

    from tokenmill.roofline import hardware

    figures = hardware._micro_benchmark(torch)
    llc = hardware.last_level_cache_bytes()
    assert figures["buffer_bytes"] >= 4 * (llc or 0)
    tries = figures["read_bandwidth_tries_bytes_s"]
    assert len(tries) >= 5
    assert min(tries) <= figures["read_bandwidth_bytes_s"] <= max(tries)
