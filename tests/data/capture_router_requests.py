"""Adds to tests/data/client_requests.json the bodies vllm-router forwards to a worker.

vllm-router (0.1.17, the test extra's pin) does not pass a request through as it came:
it re-serializes it with SGLang's fields at their defaults (`no_stop_trim`,
`return_hidden_states`, and for chat `separate_reasoning`, `stream_reasoning`,
`include_reasoning`, `continue_final_message`). This script starts the router in front
of a capture server, sends one completion and one chat request through it, and stores
what arrived (the replay test then holds tokenmill to serving them).

Run: PYTHONPATH=. python tests/data/capture_router_requests.py
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

OUT = Path(__file__).with_name("client_requests.json")
MODEL = "smollm2-135m"
REQUESTS = [("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 4}),
            ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                                      "messages": [{"role": "user", "content": "hi"}]})]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _capture_server(bodies: list) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _reply(self, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # /health, /v1/models
            self._reply({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            bodies.append((self.path, body))
            self._reply({"id": "x", "object": "text_completion", "created": 0, "model": MODEL,
                         "choices": [{"index": 0, "text": "hi", "finish_reason": "stop",
                                      "logprobs": None}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                   "total_tokens": 2}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def router_bodies() -> list[dict]:
    exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or \
        shutil.which("vllm-router")
    if exe is None:
        raise SystemExit("vllm-router is not installed (pip install vllm-router==0.1.17)")
    version = importlib.metadata.version("vllm-router")
    bodies: list = []
    worker = _capture_server(bodies)
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
         "--worker-urls", f"http://127.0.0.1:{worker.server_port}",
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        for path, body in REQUESTS:
            httpx.post(url + path, json=body, timeout=30).raise_for_status()
    finally:
        proc.terminate()
        proc.wait(10)
        worker.shutdown()
    kind = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
    return [{"client": f"vllm-router forwarded {kind[path]}", "version": f"vllm-router {version}",
             "path": path, "body": body} for path, body in bodies if path in kind]


def main() -> None:
    captured = router_bodies()
    old = json.loads(OUT.read_text()) if OUT.exists() else []
    bodies = [e for e in old if not e["client"].startswith("vllm-router")] + captured
    OUT.write_text(json.dumps(bodies, indent=1) + "\n")
    print(f"wrote {len(bodies)} bodies to {OUT} ({len(captured)} from vllm-router)")


if __name__ == "__main__":
    main()
