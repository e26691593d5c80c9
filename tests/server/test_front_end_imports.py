"""`tokenmill serve`'s front end starts without torch, transformers or xgrammar
(issue 60: their imports were the front end's share of the start-up, and the front
end had become the slower of the two processes). Checked twice: a fresh interpreter
that goes the front end's way (imports, tokenizer, a chat prompt), and a real server
whose --log-level debug start-up log says what it had loaded at the first /health."""

from __future__ import annotations

import subprocess
import sys

import httpx

from tests.serving import start_server
from tokenmill.loaders import resolve_model
from tokenmill.loaders.tokenizer import load_tokenizer

FRONT_END_PATH = """
import sys
import tokenmill.cli
parser = tokenmill.cli.build_parser(["serve"])
args = parser.parse_args(["serve", "smollm2-135m"])
from tokenmill.cli import serve
serve._fetch_hub_model(args)
serve._serving_config(args)
from tokenmill.cli.engine_args import engine_config_from_args
engine_config_from_args(args)
import tokenmill.engine.frontend.core_client, tokenmill.server.api
import tokenmill.server.engine_watchdog, uvicorn
from tokenmill.loaders import resolve_model
from tokenmill.loaders.tokenizer import load_front_end_tokenizer
from tokenmill.server.tokenizer_pool import max_token_bytes
tok = load_front_end_tokenizer(resolve_model("smollm2-135m"))
max_token_bytes(tok)
ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
assert tok.decode(ids).endswith("<|im_start|>assistant\\n"), tok.decode(ids)
print(" ".join(m for m in ("torch", "transformers", "xgrammar") if m in sys.modules) or "none")
"""


def test_the_front_end_path_imports_no_torch_and_no_transformers():
    load_tokenizer(resolve_model("smollm2-135m"))  # the tokenizer cache entry exists
    out = subprocess.run([sys.executable, "-c", FRONT_END_PATH], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.strip().splitlines()[-1] == "none"


def test_a_real_server_reaches_health_without_them_and_logs_its_phases():
    srv = start_server("smollm2-135m", "--log-level", "debug")
    try:
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4,
            "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        log = srv.log()
    finally:
        assert srv.stop() == 0
    assert "start-up modules: torch=no transformers=no xgrammar=no" in log
    phases = [line.split("start-up: ", 1)[1] for line in log.splitlines()
              if "start-up: " in line]
    for phase in ("engine core spawned", "front-end tokenizer loaded", "HTTP stack imported",
                  "core: interpreter, imports (torch)", "weights read", "core: ready sent",
                  "engine core ready", "HTTP server started: /health answers"):
        assert any(p.startswith(phase) for p in phases), (phase, phases)
