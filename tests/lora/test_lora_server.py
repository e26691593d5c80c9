"""The server with --enable-lora: a request's `model` names an adapter (same tokens as
transformers + peft), /v1/models lists adapters with `parent`, unknown names are a
404, and the runtime load/unload routes sit behind VLLM_ALLOW_RUNTIME_LORA_UPDATING."""

from __future__ import annotations

import asyncio
import threading

import httpx

from tests.lora.test_lora_engine import MAX_TOKENS, PROMPTS, references, tiny  # noqa: F401
from tests.speculative.conftest import make_llm


def test_server_routes_requests_by_adapter_name(tiny, references, monkeypatch):  # noqa: F811
    from tokenmill.engine.frontend.async_engine import AsyncEngine
    from tokenmill.server.api import build_app

    base, adapters = tiny
    llm = make_llm(base, enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=8,
                   num_kv_blocks=64, block_size=4, lora_modules=[("a0", adapters[0][0])])
    engine = AsyncEngine(llm.engine)
    threading.Thread(target=engine.run, daemon=True).start()
    app = build_app(engine, served_model_name="base")

    async def talk() -> dict:
        transport = httpx.ASGITransport(app=app)
        got = {}
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "logprobs": 0}
            got["models"] = (await c.get("/v1/models")).json()
            r = await c.post("/v1/completions", json={**body, "model": "a0"})
            got["a0"] = r.json()
            got["base"] = (await c.post("/v1/completions", json={**body, "model": "base"})).json()
            got["unknown"] = await c.post("/v1/completions", json={**body, "model": "nope"})
            got["load_off"] = await c.post("/v1/load_lora_adapter",
                                           json={"lora_name": "a1", "lora_path": adapters[1][0]})
            monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
            got["load"] = await c.post("/v1/load_lora_adapter",
                                       json={"lora_name": "a1", "lora_path": adapters[1][0]})
            got["big"] = await c.post("/v1/load_lora_adapter",
                                      json={"lora_name": "a2", "lora_path": adapters[2][0]})
            r = await c.post("/v1/completions", json={**body, "model": "a1"})
            got["a1"] = r.json()
            got["unload"] = await c.post("/v1/unload_lora_adapter", json={"lora_name": "a1"})
            got["unload_again"] = await c.post("/v1/unload_lora_adapter",
                                               json={"lora_name": "a1"})
            got["models_after"] = (await c.get("/v1/models")).json()
            got["metrics"] = (await c.get("/metrics")).text
        return got

    try:
        got = asyncio.run(talk())
    finally:
        engine.shutdown()
    cards = {m["id"]: m for m in got["models"]["data"]}
    assert cards["a0"]["parent"] == "base" and cards["base"]["parent"] is None

    tok = llm.engine.tokenizer
    assert got["a0"]["choices"][0]["text"] == tok.decode(references[1][0][0])
    assert got["base"]["choices"][0]["text"] == tok.decode(references[0][0][0])
    assert got["a1"]["choices"][0]["text"] == tok.decode(references[2][0][0])
    assert got["unknown"].status_code == 404
    assert "'nope'" in got["unknown"].json()["error"]["message"]
    assert got["load_off"].status_code == 404
    assert got["load"].status_code == 200, got["load"].text
    assert got["big"].status_code == 400
    assert "more than --max-lora-rank 8" in got["big"].json()["error"]["message"]
    assert got["unload"].status_code == 200
    assert got["unload_again"].status_code == 404
    assert "a1" not in {m["id"] for m in got["models_after"]["data"]}
    assert ':lora_requests_info{max_lora="2"' in got["metrics"]
