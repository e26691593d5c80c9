"""Chat-template choices, without an engine: the app runs on a stand-in engine
that only has to hold a tokenizer."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from tokenmill.engine.core.stats import EngineStats
from tokenmill.server.api import build_app
from tokenmill.server.chat_template import content_format, load_chat_template
from tokenmill.server.serving import ServingConfig


@pytest.fixture(scope="module")
def tokenizer():
    from tokenmill.loaders import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("smollm2-135m"))


def _app(tokenizer, **config) -> TestClient:
    llm = SimpleNamespace(tokenizer=tokenizer, model_name="m", max_model_len=2048,
                          model_config=SimpleNamespace(vocab_size=len(tokenizer)))
    engine = SimpleNamespace(engine=llm, stats=EngineStats(), shutdown=lambda: None,
                             core_pid=None)
    return TestClient(build_app(engine, config=ServingConfig(**config)))


def test_a_model_without_a_chat_template_gets_a_clear_400(tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with _app(bare) as client:
        r = client.post("/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "no_chat_template" and "--chat-template" in err["message"]
        r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400
    with _app(bare, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}") as c:
        r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["tokens"] == tokenizer.encode("hi")


def test_openai_content_format_hands_the_template_parts(tokenizer):
    template = ("{% for m in messages %}{% for part in m['content'] %}({{ part['text'] }})"
                "{% endfor %}{% endfor %}")
    assert content_format("auto", template) == "openai"
    assert content_format("auto", "{{ messages[0]['content'] }}") == "string"
    with _app(tokenizer, chat_template=template, chat_template_content_format="auto") as c:
        r = c.post("/tokenize", json={"messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
        assert r.status_code == 200
        assert tokenizer.decode(r.json()["tokens"]) == "(a)(b)"


def test_reserved_template_kwargs_and_per_request_templates_are_refused(tokenizer):
    with _app(tokenizer) as c:
        msgs = [{"role": "user", "content": "hi"}]
        r = c.post("/tokenize", json={"messages": msgs,
                                      "chat_template_kwargs": {"tokenize": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
        r = c.post("/tokenize", json={"messages": msgs, "chat_template": "{{ x }}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_chat_template_arg_is_a_file_or_the_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert load_chat_template(str(path)) == "{{ messages }}"
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template("missing.jinja")
