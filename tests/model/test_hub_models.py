"""Models named by their Hub id, through the real huggingface_hub client against
a local fake Hub (tests/model/fake_hub.py) and a cache layout written by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx

from tests.model.fake_hub import FakeHub
from tests.serving import start_server

REPO = "tiny-org/tiny-llama"


def _env(tmp_path, hub: FakeHub | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1", **extra)
    if hub is not None:
        env["HF_ENDPOINT"] = hub.url
    return env


def _fetch(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """fetch_model in a fresh interpreter: huggingface_hub reads HF_* at import."""
    code = ("import sys; from tokenmill.loaders.hub import fetch_model\n"
            "print(fetch_model(*sys.argv[1:2], gguf_file=(sys.argv[2:] or [None])[0]))")
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_serve_downloads_a_hub_model_and_serves_it_by_its_id(tmp_path, tiny_model):
    with FakeHub() as hub:
        commit = hub.add_directory(REPO, tiny_model, **{"pytorch_model.bin": b"x" * 100,
                                                        "README.md": b"# tiny"})
        srv = start_server(REPO, "--max-model-len", "256", env=_env(tmp_path, hub))
        try:
            models = httpx.get(f"{srv.base_url}/v1/models").json()["data"]
            assert [m["id"] for m in models] == [REPO]
            r = httpx.post(f"{srv.base_url}/v1/completions", timeout=60, json={
                "model": REPO, "prompt": "Hello", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        finally:
            srv.stop()
    served = {name.removeprefix(REPO + "/") for name in hub.served}
    assert "config.json" in served and "model.safetensors" in served
    assert "tokenizer.json" in served
    assert not served & {"pytorch_model.bin", "README.md"}  # only what a checkpoint needs
    snapshot = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / commit
    assert (snapshot / "config.json").is_file()
    assert (tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama" / "refs" / "main"
            ).read_text() == commit


def test_offline_mode_uses_the_cache_only(tmp_path):
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hf" / "hub" / "models--cached-org--cached-model"
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (snapshot / "model.safetensors").write_bytes(b"")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)
    env = _env(tmp_path, HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")  # unreachable
    done = _fetch(env, "cached-org/cached-model")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(snapshot)
    missing = _fetch(env, "cached-org/other-model")
    assert missing.returncode != 0
    assert "'cached-org/other-model' is not in the Hugging Face cache" in missing.stderr
    assert "HF_HUB_OFFLINE=1" in missing.stderr


def test_missing_repo_is_a_clear_error_from_serve(tmp_path):
    with FakeHub() as hub:
        done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "no-org/nothing"],
                              env=_env(tmp_path, hub), capture_output=True, text=True,
                              timeout=120, check=False)
    assert done.returncode != 0
    assert "has no model 'no-org/nothing'" in done.stderr and "network" in done.stderr
    assert "Traceback" not in done.stderr
    unreachable = _fetch(_env(tmp_path, HF_ENDPOINT="http://127.0.0.1:9"), "no-org/nothing")
    assert "is not in the Hugging Face cache" in unreachable.stderr
    assert "could not be reached" in unreachable.stderr


def test_gguf_repo_fetches_only_the_file_asked_for(tmp_path):
    with FakeHub() as hub:
        hub.add_repo("gg-org/model-GGUF", {"model-Q4_K_M.gguf": b"GGUF" + b"\0" * 60,
                                           "model-Q8_0.gguf": b"GGUF" + b"\1" * 60,
                                           "README.md": b"#"})
        by_quant = _fetch(_env(tmp_path, hub), "gg-org/model-GGUF:Q4_K_M")
        by_name = _fetch(_env(tmp_path, hub), "gg-org/model-GGUF", "model-Q8_0.gguf")
        no_weights = _fetch(_env(tmp_path, hub), "gg-org/model-GGUF")
    assert by_quant.stdout.strip().endswith("model-Q4_K_M.gguf"), by_quant.stderr
    assert by_name.stdout.strip().endswith("model-Q8_0.gguf"), by_name.stderr
    assert sorted(hub.served) == ["gg-org/model-GGUF/model-Q4_K_M.gguf",
                                  "gg-org/model-GGUF/model-Q8_0.gguf"]
    assert "pass --gguf-file NAME or ORG/NAME:QUANT" in no_weights.stderr


def test_hub_flags_on_a_local_model_are_refused():
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "smollm2-135m",
                           "--gguf-file", "x.gguf"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode != 0 and "--gguf-file is for a model named by its" in done.stderr
