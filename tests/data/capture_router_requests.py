"""Adds to tests/data/client_requests.json the bodies vllm-router forwards to a worker.

vllm-router (0.1.17, the test extra's pin) does not pass a request through as it came:
it re-serializes it with SGLang's fields at their defaults (`no_stop_trim`,
`return_hidden_states`, and for chat `separate_reasoning`, `stream_reasoning`,
`include_reasoning`, `continue_final_message`). This script starts the router in front
of a capture server, sends one completion and one chat request through it, and stores
what arrived (the replay test then holds tokenmill to serving them).

It also records what the router's `--vllm-pd-disaggregation` mode sends (to
`router_pd_requests.json`): the request it POSTs to the prefill instance, the
`X-Request-Id` header, and the request it then sends to the decode instance with the
prefill reply's `kv_transfer_params` copied in (the capture prefill answers a planted
`kv_transfer_params`, so the test can see it arrive verbatim).

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
PD_OUT = Path(__file__).with_name("router_pd_requests.json")
# what the capture prefill answers: the decode request must carry it verbatim
PLANTED = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "engine-x",
           "remote_block_ids": [3, 4], "remote_host": "127.0.0.1", "remote_port": 5600,
           "remote_request_id": "req-x", "first_token_id": 42}
MODEL = "smollm2-135m"
REQUESTS = [("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 4}),
            ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                                      "messages": [{"role": "user", "content": "hi"}]})]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _capture_server(bodies: list, headers: list | None = None,
                    kv_transfer_params: dict | None = None) -> ThreadingHTTPServer:
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
            if headers is not None:
                headers.append({k.lower(): v for k, v in self.headers.items()
                                if k.lower().startswith("x-")})
            extra = {} if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
            self._reply({**extra,"id": "x", "object": "text_completion", "created": 0, "model": MODEL,
                         "choices": [{"index": 0, "text": "hi", "finish_reason": "stop",
                                      "logprobs": None}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                   "total_tokens": 2}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _router_exe() -> str:
    exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or \
        shutil.which("vllm-router")
    if exe is None:
        raise SystemExit("vllm-router is not installed (pip install vllm-router==0.1.17)")
    return exe


def _wait_healthy(url: str) -> None:
    for _ in range(120):
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"{url} never became healthy")


def router_bodies() -> list[dict]:
    exe = _router_exe()
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
        _wait_healthy(url)
        for path, body in REQUESTS:
            httpx.post(url + path, json=body, timeout=30).raise_for_status()
    finally:
        proc.terminate()
        proc.wait(10)
        worker.shutdown()
    kind = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
    return [{"client": f"vllm-router forwarded {kind[path]}", "version": f"vllm-router {version}",
             "path": path, "body": body} for path, body in bodies if path in kind]


def router_pd_requests() -> dict:
    """What `--vllm-pd-disaggregation` sends to a prefill and then a decode instance."""
    exe = _router_exe()
    version = importlib.metadata.version("vllm-router")
    prefill_bodies: list = []
    prefill_headers: list = []
    decode_bodies: list = []
    decode_headers: list = []
    prefill = _capture_server(prefill_bodies, prefill_headers, PLANTED)
    decode = _capture_server(decode_bodies, decode_headers)
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
         "--prefill", f"http://127.0.0.1:{prefill.server_port}",
         "--decode", f"http://127.0.0.1:{decode.server_port}", "--policy", "round_robin",
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url)
        for path, body in REQUESTS:
            httpx.post(url + path, json=body, timeout=30).raise_for_status()
            httpx.post(url + path, json={**body, "stream": True}, timeout=30).raise_for_status()
    finally:
        proc.terminate()
        proc.wait(10)
        prefill.shutdown()
        decode.shutdown()
    return {"version": f"vllm-router {version}", "planted_kv_transfer_params": PLANTED,
            "prefill": [{"path": p, "body": b, "headers": h}
                        for (p, b), h in zip(prefill_bodies, prefill_headers)],
            "decode": [{"path": p, "body": b, "headers": h}
                       for (p, b), h in zip(decode_bodies, decode_headers)]}


def main() -> None:
    captured = router_bodies()
    old = json.loads(OUT.read_text()) if OUT.exists() else []
    bodies = [e for e in old if not e["client"].startswith("vllm-router")] + captured
    OUT.write_text(json.dumps(bodies, indent=1) + "\n")
    print(f"wrote {len(bodies)} bodies to {OUT} ({len(captured)} from vllm-router)")
    pd = router_pd_requests()
    PD_OUT.write_text(json.dumps(pd, indent=1) + "\n")
    print(f"wrote {len(pd['prefill'])} prefill and {len(pd['decode'])} decode requests to {PD_OUT}")


if __name__ == "__main__":
    main()
