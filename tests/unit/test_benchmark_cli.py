"""`python -m benchmarks`: one entry point over every benchmark; `run all` hands each
workload the options it takes and names the ones it does not."""

from __future__ import annotations

import pytest

from benchmarks import cli
from benchmarks.registry import BENCHMARKS, WORKLOADS


def test_list_names_every_benchmark(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {b.name} " in out for b in BENCHMARKS)
    assert WORKLOADS == ("w1", "w2", "w3", "w4", "w5")


def test_an_unknown_benchmark_is_refused_by_name(capsys):
    assert cli.main(["run", "w9"]) == 2
    assert "no benchmark named 'w9'" in capsys.readouterr().err


def test_run_all_gives_each_workload_its_own_peers_and_options():
    # W1's peers are vllm and transformers: --peers llama leaves it none
    assert cli.all_argv("w1", "llama", False, "f.gguf", 3) == (
        ["--skip-peers", "--repeats", "3"], ["--model"])
    assert cli.all_argv("w3", "llama,vllm", False, "f.gguf", None) == (
        ["--peers", "llama", "--model", "f.gguf"], [])
    # W2 repeats its servers' sweeps, alternated (a VM's drift falls on each alike)
    assert cli.all_argv("w2", None, False, None, 5) == (["--repeats", "5"], [])
    assert cli.all_argv("w5", "vllm", True, None, None) == (["--skip-peers"], [])


def test_run_all_refuses_an_unknown_peer_by_name(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "all", "--peers", "llama,sglang"])
    assert "--peers: sglang is not a peer" in capsys.readouterr().err


def test_every_benchmark_parses_its_own_arguments(capsys):
    """Each module imports as a package member (no sys.path) and has main(argv); the ones
    that write a result can be told not to, and W2-W4 take the model file."""
    for b in BENCHMARKS:
        with pytest.raises(SystemExit) as e:
            cli.main(["run", b.name, "--help"])
        assert e.value.code == 0, b.name
        out = capsys.readouterr().out
        assert ("--no-result" in out) == b.writes_result, b.name
        assert ("--model" in out) >= (b.name in ("w2", "w3", "w4")), b.name
