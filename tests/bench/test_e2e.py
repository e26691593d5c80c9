"""`tokenmill bench` against a real `tokenmill serve` on the embedded model."""

import json
import struct
import subprocess
import sys
import time

import httpx
import pytest

from tests.serving import start_server
from tokenmill.cli import main as cli_main
from tokenmill.quant.default_arithmetic import default_gguf_arithmetic

pytestmark = pytest.mark.slow  # a real model on a shared CPU: minutes, not seconds

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SMALL = ["--input-len", "32", "--output-len", "16", "--num-requests", "8", "--no-progress",
         "--tokenizer", "smollm2-135m"]

SUMMARY_FIELDS = (
    "output_throughput_tok_s", "total_throughput_tok_s", "request_throughput",
    "peak_output_throughput_tok_s", "mean_in_flight", "mean_input_tokens",
    "mean_output_tokens", "num_completed", "num_failed", "failures", "ttft_ms", "tpot_ms",
    "itl_ms", "e2e_ms", "goodput_req_s", "slo_attainment", "cost_per_1m_output_tokens",
    "cost_per_1m_total_tokens", "generator_lag_s", "duration_s")
CONFIG_FIELDS = ("model", "base_url", "endpoint", "backend", "dtype", "concurrency",
                 "request_rate", "burstiness", "num_requests", "workload")
RECORD_FIELDS = ("send_time_s", "ttft_s", "chunk_times_s", "chunk_tokens",
                 "input_tokens_server", "input_tokens_client", "output_tokens_server",
                 "output_tokens_client", "error")


def check_complete_run(res: dict, n: int = 8, out_len: int = 16) -> None:
    for key in CONFIG_FIELDS:
        assert key in res["config"], key
    for key in SUMMARY_FIELDS:
        assert key in res["summary"], key
    for stat in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(res["summary"][stat]) >= {"mean", "std", "p50", "p90", "p95", "p99", "max"}
    s = res["summary"]
    assert (s["num_completed"], s["num_failed"]) == (n, 0), s["failures"]
    assert len(res["requests"]) == n
    for r in res["requests"]:
        for key in RECORD_FIELDS:
            assert key in r, key
        assert r["error"] is None
        assert r["output_tokens_server"] == out_len  # ignore_eos + max_tokens honoured
        assert r["input_tokens_server"] == r["input_tokens_client"] == 32
        assert r["ttft_s"] > 0 and r["chunk_times_s"] == sorted(r["chunk_times_s"])
    check = s["token_count_check"]
    # the client's re-tokenization of the text may merge a token now and then
    assert check["output_mismatched"] <= 1, check
    assert s["mean_output_tokens"] == out_len


def png_ok(path) -> bool:
    data = path.read_bytes()
    width, height = struct.unpack(">II", data[16:24])
    return data.startswith(PNG_SIGNATURE) and width >= 400 and height >= 300


def test_concurrency_mode_json_and_plots(server, tmp_path):
    out = tmp_path / "conc.json"
    code = cli_main(["bench", "--base-url", server.base_url, "--concurrency", "4", *SMALL,
                     "--slo", "ttft_ms=60000", "--cost-per-hour", "1.0",
                     "--output", str(out), "--plot", str(tmp_path / "plots")])
    assert code == 0
    res = json.loads(out.read_text())
    check_complete_run(res)
    assert res["config"]["backend"] == "openai" and res["config"]["concurrency"] == 4
    assert res["summary"]["mean_in_flight"] <= 4.0 + 1e-6
    assert res["summary"]["cost_per_1m_output_tokens"] > 0
    for name in ("ttft_cdf", "tpot_cdf", "timeline"):
        assert png_ok(tmp_path / "plots" / f"{name}.png"), name


def test_rate_mode_chat(server, tmp_path):
    out = tmp_path / "rate.json"
    code = cli_main(["bench", "--base-url", server.base_url, "--request-rate", "4",
                     "--endpoint", "chat", *SMALL, "--output", str(out)])
    assert code == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    assert (s["num_completed"], s["num_failed"]) == (8, 0), s["failures"]
    assert res["config"]["request_rate"] == 4.0
    planned = [r["planned_time_s"] for r in res["requests"]]
    assert planned == sorted(planned) and planned[-1] > 0
    for r in res["requests"]:
        assert r["output_tokens_server"] == 16
        assert r["input_tokens_server"] == r["input_tokens_client"]  # chat template counted
    assert s["token_count_check"]["output_mismatched"] <= 1


def _finished_requests(base_url: str) -> float:
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tokenmill:request_success_total"))


def test_server_dying_mid_run(tmp_path):
    srv = start_server("smollm2-135m", "--max-num-seqs", "4")
    out = tmp_path / "dead.json"
    bench = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "bench", "--base-url", srv.base_url,
         "--concurrency", "2", "--input-len", "16", "--output-len", "16",
         "--num-requests", "16", "--no-progress", "--tokenizer", "smollm2-135m",
         "--output", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while _finished_requests(srv.base_url) < 1 and time.monotonic() < deadline:
            assert bench.poll() is None, bench.communicate()
            time.sleep(0.5)
        srv.proc.kill()  # no graceful shutdown: the server dies
        stdout, stderr = bench.communicate(timeout=120)
    finally:
        srv.stop()
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 1, (stdout, stderr)
    assert "did the server die" in stderr
    res = json.loads(out.read_text())
    s = res["summary"]
    assert s["num_completed"] >= 1 and s["num_failed"] >= 1
    assert s["num_completed"] + s["num_failed"] == 16  # every request accounted for
    assert set(s["failures"]) <= {"connect", "disconnected", "incomplete"}


def test_offline_engine_target(tmp_path, capsys):
    out = tmp_path / "offline.json"
    code = cli_main(["bench", "--offline", "smollm2-135m", "--concurrency", "2",
                     "--input-len", "32", "--output-len", "8", "--num-requests", "4",
                     "--no-progress", "--output", str(out)])
    assert code == 0
    res = json.loads(out.read_text())
    check_complete_run(res, n=4, out_len=8)
    assert res["config"]["backend"] == "offline" and res["config"]["base_url"] is None
    e = res["engine"]
    assert set(e["time_s"]) == {"schedule", "prepare", "forward", "sample", "postprocess"}
    assert e["num_steps"] > 0 and e["wall_time_s"] > 0
    assert e["num_prefill_tokens"] >= 4 * 32
    assert 1.0 <= e["mean_decode_batch"] <= 2.0
    assert sum(e["time_s"].values()) <= e["wall_time_s"] * 1.01
    # the weights the engine resolved, not the flag's "auto": explain holds the run to the
    # embedded file's Q4_1 bytes (it read bf16 before)
    default = default_gguf_arithmetic()
    assert res["config"]["quantization"] == default.method
    assert res["config"]["engine_args"]["quantization"] == default.method
    assert res["config"]["quantization_reason"] == default.reason
    capsys.readouterr()
    assert cli_main(["explain", str(out), "--json", "--bandwidth", "47", "--flops", "0.435"]) == 0
    explained = json.loads(capsys.readouterr().out)
    assert explained["dtype"].startswith("gguf:")
    assert f"weights: {default.reason}" in explained["notes"]  # the path, and why
