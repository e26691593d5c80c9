"""Issue 22: tokenmill says what it runs (`GET /server_info`), the bench records it, and
explain then does not recommend a lever the run already pulled."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

from tokenmill.bench.target_config import fetch_server_config, normalize, parse_vllm_config
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.engine.core.server_info import server_info

VLLM_REPR = ("model='/models/smol', speculative_config=None, tokenizer='/models/smol', "
             "dtype=torch.bfloat16, max_seq_len=4096, quantization=None, "
             "enable_prefix_caching=True, chunked_prefill_enabled=True, "
             "kv_cache_dtype='fp8', max_num_seqs=256, max_num_batched_tokens=2048")


def test_server_info_carries_the_engine_flags():
    config = EngineConfig(max_num_seqs=12, max_num_batched_tokens=256, speculative="ngram",
                          cache=CacheConfig(enable_prefix_caching=False))
    llm = SimpleNamespace(config=config, model_name="smollm2-135m", max_model_len=2048,
                          get_stats=lambda: SimpleNamespace(num_total_blocks=100),
                          runner=SimpleNamespace(kv_cache_bytes=100 * 368_640))
    info = server_info(llm)
    assert info["engine"] == "tokenmill" and info["onednn_precompile"] is None  # no engine's
    assert (info["max_num_seqs"], info["max_num_batched_tokens"]) == (12, 256)
    assert info["enable_chunked_prefill"] is True and info["enable_prefix_caching"] is False
    assert info["speculative"] == "ngram" and info["num_speculative_tokens"] == 4
    assert info["kv_cache_dtype"] == "auto" and info["num_kv_blocks"] == 100
    assert info["kv_pool_bytes"] == 100 * 368_640  # what the pool allocated (served-rss)
    json.dumps(info)  # JSON-able as it is


def test_vllm_server_info_is_read_into_the_same_names():
    cfg = normalize({"vllm_config": VLLM_REPR})
    assert cfg["engine"] == "vllm"
    assert cfg["enable_chunked_prefill"] is True and cfg["enable_prefix_caching"] is True
    assert cfg["kv_cache_dtype"] == "fp8" and cfg["max_num_seqs"] == 256
    assert cfg["max_model_len"] == 4096 and cfg["speculative"] is None
    assert parse_vllm_config("speculative_config=SpeculativeConfig(method='ngram')")[
        "speculative"] == "on"
    assert normalize({"something": "else"}) is None


# llama-server's GET /props (llama-cpp-python 0.3.36's server), the fields read
LLAMA_PROPS = {"total_slots": 16, "model_alias": "smollm2-135m", "model_ftype": "Q4_1",
               "model_path": "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
               "default_generation_settings": {"n_ctx": 1024}, "build_info": "b0-unknown"}


def test_llama_server_props_are_read_into_the_same_names():
    # llama-server has no /server_info: its /props says which GGUF it runs and how many
    # slots, so explain holds its runs against the file's bytes, not a bf16 preset's
    from tests.bench.fakes import FakeServer

    with FakeServer(props=LLAMA_PROPS) as srv:
        cfg = asyncio.run(fetch_server_config(srv.base_url + "/v1", None))
    assert cfg == {"engine": "llama.cpp", "model": "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                   "quantization": "gguf-a8", "gguf_type": "Q4_1", "max_num_seqs": 16}


def test_a_server_without_server_info_gives_none():
    from tests.bench.fakes import FakeServer

    with FakeServer() as srv:
        assert asyncio.run(fetch_server_config(srv.base_url, None)) is None


@pytest.mark.slow
def test_served_config_reaches_the_bench_result_and_explain(tmp_path, capsys):
    from tests.serving import start_server, wait_until
    from tokenmill.cli import main

    srv = start_server("smollm2-135m", "--max-num-seqs", "8", "--max-num-batched-tokens",
                       "128", "--num-kv-blocks", "64")
    try:
        info = httpx.get(f"{srv.base_url}/server_info").json()
        assert info["engine"] == "tokenmill" and info["max_num_seqs"] == 8
        assert info["max_num_batched_tokens"] == 128 and info["num_kv_blocks"] == 64
        # the packed matmuls' oneDNN compile runs in the core once it answers, and
        # /server_info follows it to the end
        precompile = info["onednn_precompile"]
        if precompile["why"] != "no packed large-batch linears":  # else: none on this CPU
            assert precompile["state"] in ("pending", "running", "done"), precompile
            assert wait_until(lambda: httpx.get(f"{srv.base_url}/server_info").json()[
                "onednn_precompile"]["state"] == "done", 120, 0.2)
            done = httpx.get(f"{srv.base_url}/server_info").json()["onednn_precompile"]
            assert done["shapes"] > 0 and done["seconds"] > 0
            assert f"{done['shapes']} oneDNN shapes compiled in the background" in srv.log()
        out = tmp_path / "run.json"
        assert main(["bench", "--base-url", srv.base_url, "--concurrency", "2",
                     "--input-len", "16", "--output-len", "8", "--num-requests", "4",
                     "--no-progress", "--tokenizer", "smollm2-135m", "--output",
                     str(out)]) == 0
    finally:
        srv.stop()
    result = json.loads(out.read_text())
    assert result["config"]["server_config"]["max_num_batched_tokens"] == 128
    capsys.readouterr()
    assert main(["explain", str(out), "--bandwidth", "47", "--json"]) == 0
    levers = json.loads(capsys.readouterr().out)["levers"]
    assert not any(lv["name"].startswith(("chunked prefill", "prefix caching"))
                   for lv in levers), levers
