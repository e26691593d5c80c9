"""benchmarks/peers: a peer that cannot be set up or started is reported with its
reason (so a benchmark skips it), and a wrong --peers value is refused by name.
No peer is installed or run here: the setup scripts fail early on purpose."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks import peers


def test_failed_setup_gives_the_scripts_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_PEERS_DIR", str(tmp_path))
    monkeypatch.setenv("PYTHON", "/bin/false")  # its `pip download` fails at once
    llama, why = peers.ensure_llama_cpp.__wrapped__()
    assert llama is None
    # the script's own last message, e.g. "pip download llama-cpp-python==0.3.36 failed"
    assert why.startswith("build_llama_cpp.sh exited with 1: build_llama_cpp.sh: ")
    assert not any(tmp_path.glob("llama.cpp/build-*")), "nothing built after the failure"


def test_server_that_dies_at_start_is_an_error_with_its_log(tmp_path):
    fake = peers.LlamaCpp(server=Path("/bin/false"), bench=Path("/bin/false"))
    with pytest.raises(RuntimeError, match=r"llama-server .* exited with 1 before it was ready"):
        peers.start_llama_server(fake, tmp_path / "model.gguf", ready_timeout_s=20)


def test_unknown_peer_is_refused_by_name():
    ap = argparse.ArgumentParser()
    peers.add_peer_args(ap, ("vllm", "llama"))
    with pytest.raises(SystemExit, match="transformers is not a peer of this benchmark"):
        peers.selected_peers(ap.parse_args(["--peers", "vllm,transformers"]), ("vllm", "llama"))
    assert peers.selected_peers(ap.parse_args([]), ("vllm", "llama")) == {"vllm", "llama"}
    assert peers.selected_peers(ap.parse_args(["--skip-peers"]), ("vllm", "llama")) == set()


def test_vllm_threads_setting_is_checked():
    env = peers.servers.vllm_env("both")
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in peers.servers.vllm_env("default")
    with pytest.raises(ValueError, match="'both' or 'default'"):
        peers.servers.vllm_env("all")
