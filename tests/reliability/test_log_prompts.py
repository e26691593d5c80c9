"""--log-prompts puts a request's prompt in the log; without it the prompt never
appears there. The app runs on a stand-in engine that refuses every request."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from tokenmill.engine.core.stats import EngineStats
from tokenmill.engine.frontend.async_engine import QueueFullError
from tokenmill.server.api import build_app
from tokenmill.server.serving import ServingConfig

SECRET = "marmalade-quasar-4410"


@pytest.fixture(scope="module")
def tokenizer():
    from tokenmill.loaders import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("smollm2-135m"))


async def _refuse(*args, **kwargs):
    raise QueueFullError("full")


@pytest.mark.parametrize("log_prompts", [False, True])
def test_prompts_reach_the_log_only_with_log_prompts(tokenizer, caplog, log_prompts):
    llm = SimpleNamespace(tokenizer=tokenizer, model_name="m", max_model_len=2048,
                          model_config=SimpleNamespace(vocab_size=len(tokenizer)))
    engine = SimpleNamespace(engine=llm, stats=EngineStats(), shutdown=lambda: None,
                             add_request=_refuse)
    app = build_app(engine, config=ServingConfig(log_prompts=log_prompts))
    caplog.set_level(logging.DEBUG)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": f"tell me {SECRET}"})
        assert r.status_code == 503
        r = client.post("/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": SECRET}]})
        assert r.status_code == 503
    logged = [rec.getMessage() for rec in caplog.records if SECRET in rec.getMessage()]
    assert len(logged) == (2 if log_prompts else 0), logged
