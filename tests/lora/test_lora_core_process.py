"""Adapters behind the engine core process (`tokenmill serve`'s default layout): the
front end sends each request's adapter over the IPC, and --lora-modules, /v1/models,
the runtime load/unload routes and unknown names behave as in-process."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.lora.test_lora_engine import MAX_TOKENS, PROMPTS, tiny  # noqa: F401
from tests.serving import start_server
from tests.speculative.conftest import make_llm
from tokenmill import SamplingParams
from tokenmill.lora_request import LoRARequest

pytest.importorskip("peft")


def _in_process_texts(base: str, paths: list[str]) -> dict[tuple[str, int], str]:
    """(model, prompt index) -> the in-process engine's greedy text."""
    llm = make_llm(base, enable_lora=True, max_loras=3, max_lora_rank=16, num_kv_blocks=64)
    loras = {"base": None, **{f"a{i}": LoRARequest(f"a{i}", i + 1, p)
                              for i, p in enumerate(paths)}}
    jobs = [(name, i) for name in loras for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([PROMPTS[i] for _, i in jobs], params, use_tqdm=False,
                        lora_request=[loras[name] for name, _ in jobs])
    texts = {job: out.outputs[0].text for job, out in zip(jobs, outs)}
    llm.engine.close()
    return texts


def test_serve_with_an_engine_core_process_routes_adapters_by_name(tiny):  # noqa: F811
    base, adapters = tiny
    paths = [path for path, _ in adapters]
    expected = _in_process_texts(base, paths)
    srv = start_server(base, "--dtype", "float32", "--served-model-name", "base",
                       "--enable-lora", "--lora-modules", f"a0={paths[0]}",
                       f'{{"name": "a1", "path": "{paths[1]}"}}', "--max-loras", "3",
                       "--max-lora-rank", "16", "--max-cpu-loras", "3",
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        url = srv.base_url

        def complete(model: str, i: int) -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": model, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True})

        cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert cards["a0"]["parent"] == "base" and cards["a1"]["parent"] == "base"
        assert cards["a0"]["root"] == paths[0] and cards["base"]["parent"] is None
        # every prompt under each adapter and the base, all at once
        jobs = [(name, i) for name in ("base", "a0", "a1") for i in range(2)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda job: complete(*job), jobs))
        for job, r in zip(jobs, answers):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected[job], job
            assert r.json()["model"] == job[0]
        # the adapters change the output, so a base answer under an adapter's name fails
        assert expected[("a0", 0)] != expected[("base", 0)]
        # streamed: every chunk, the usage one included, names the adapter
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "model": "a1", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        assert {e["model"] for e in events} == {"a1"} and events[-1]["usage"]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) \
            == expected[("a1", 1)]
        # the core's step stats reach the front end's metrics (vLLM's adapter gauge)
        assert ':lora_requests_info{max_lora="3"' in httpx.get(f"{url}/metrics").text

        unknown = complete("nope", 0)
        assert unknown.status_code == 404
        assert "'nope'" in unknown.json()["error"]["message"]

        # the runtime routes reach the core: load a2 (rank 16), serve it, unload it
        load = httpx.post(f"{url}/v1/load_lora_adapter", timeout=120,
                          json={"lora_name": "a2", "lora_path": paths[2]})
        assert load.status_code == 200, load.text
        assert "a2" in {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
        r = complete("a2", 1)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[("a2", 1)]
        again = httpx.post(f"{url}/v1/load_lora_adapter", timeout=120,
                           json={"lora_name": "a2", "lora_path": paths[2]})
        assert again.status_code == 400 and "'a2' is already loaded" in again.text
        bad = httpx.post(f"{url}/v1/load_lora_adapter", timeout=120,
                         json={"lora_name": "a3", "lora_path": "/no/such/adapter"})
        assert bad.status_code == 400 and "a3" in bad.json()["error"]["message"]
        unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert unload.status_code == 200, unload.text
        gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert gone.status_code == 404 and "'a2'" in gone.json()["error"]["message"]
        assert complete("a2", 1).status_code == 404
        assert "a2" not in {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert complete("a1", 0).json()["choices"][0]["text"] == expected[("a1", 0)]
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
