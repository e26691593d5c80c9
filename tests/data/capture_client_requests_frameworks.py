"""Captures, off the wire, the request bodies that langchain-openai, instructor
and guidellm send, into tests/data/client_requests.json (replacing their
entries; the others are kept).

Each client is pointed at a capture server on 127.0.0.1 (stdlib http.server in
a thread) that records path + JSON body and answers with a minimal valid OpenAI
reply (JSON, or an SSE stream ending in `data: [DONE]` when `stream` is true),
scripted per call so that the client completes it: a tool call for a tool loop,
an invalid one first for instructor's retry.

The clients are not tokenmill's dependencies: run it with a throwaway venv's
python (versions captured: langchain-openai 1.7.4 + langchain-core 1.8.3,
instructor 1.17.0, guidellm 0.8.1, over openai 3.3.0):

    python3 -m venv /tmp/clients-venv
    /tmp/clients-venv/bin/pip install langchain-openai==1.7.4 instructor==1.17.0 \
        guidellm==0.8.1
    # guidellm's synthetic data needs a tokenizer directory: the embedded model's
    PYTHONPATH=. python -c "from tokenmill.loaders.model_source import resolve_model; \
        from tokenmill.loaders.tokenizer import load_tokenizer; \
        load_tokenizer(resolve_model('smollm2-135m')).save_pretrained('/tmp/smol-tok')"
    /tmp/clients-venv/bin/python tests/data/capture_client_requests_frameworks.py \
        --tokenizer /tmp/smol-tok
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m"
OUT = Path(__file__).with_name("client_requests.json")
OWNED = ("langchain-openai", "instructor", "guidellm")  # the entries this script writes
CITY_JSON = '{"city": "Paris", "country": "France"}'
QUESTION = "What is the weather in Paris?"


def _tool_call(name: str, arguments: str, call_id: str = "call_1") -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


def _text(content: str) -> dict:
    return {"role": "assistant", "content": content}


class CaptureServer(ThreadingHTTPServer):
    """Records every POST; answers with the next scripted chat message (else text)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.captured: list[dict] = []
        self.replies: list[dict] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def take(self) -> list[dict]:
        with self.lock:
            taken, self.captured = self.captured, []
        return taken

    def next_reply(self) -> dict:
        with self.lock:
            return self.replies.pop(0) if self.replies else _text("Sunny, 21 C.")


class _Handler(BaseHTTPRequestHandler):
    server: CaptureServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.rstrip("/").endswith("/models"):
            body = {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                "owned_by": "capture"}]}
            self._send(200, json.dumps(body).encode(), "application/json")
        else:  # /health
            self._send(200, b"{}", "application/json")

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.loads(raw)
        path = self.path.split("?")[0]
        with self.server.lock:
            self.server.captured.append({"path": path, "body": body})
        chat = path.endswith("/chat/completions")
        message = self.server.next_reply()
        if body.get("stream"):
            events = _chat_chunks(message) if chat else _text_chunks(message["content"])
            if (body.get("stream_options") or {}).get("include_usage"):
                events.append({"id": "x", "object": events[0]["object"], "created": 0,
                               "model": MODEL, "choices": [], "usage": _USAGE})
            payload = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            self._send(200, payload.encode(), "text/event-stream")
            return
        if chat:
            reply = {"id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
                     "choices": [{"index": 0, "message": message, "logprobs": None,
                                  "finish_reason": "tool_calls" if message.get("tool_calls")
                                  else "stop"}], "usage": _USAGE}
        else:
            reply = {"id": "x", "object": "text_completion", "created": 0, "model": MODEL,
                     "choices": [{"index": 0, "text": message["content"], "logprobs": None,
                                  "finish_reason": "stop"}], "usage": _USAGE}
        self._send(200, json.dumps(reply).encode(), "application/json")


_USAGE = {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12}


def _chat_chunks(message: dict) -> list[dict]:
    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish}]}

    if message.get("tool_calls"):
        calls = [dict(call, index=i) for i, call in enumerate(message["tool_calls"])]
        return [chunk({"role": "assistant", "content": None, "tool_calls": calls}),
                chunk({}, "tool_calls")]
    words = message["content"].split(" ")
    return ([chunk({"role": "assistant", "content": ""})]
            + [chunk({"content": w if i == 0 else " " + w}) for i, w in enumerate(words)]
            + [chunk({}, "stop")])


def _text_chunks(text: str) -> list[dict]:
    return [{"id": "x", "object": "text_completion", "created": 0, "model": MODEL,
             "choices": [{"index": 0, "text": w if i == 0 else " " + w, "logprobs": None,
                          "finish_reason": None}]} for i, w in enumerate(text.split(" "))] + [
        {"id": "x", "object": "text_completion", "created": 0, "model": MODEL,
         "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]}]


def _version(dist: str) -> str:
    return importlib.metadata.version(dist)


def _named(server: CaptureServer, client: str, dist: str) -> list[dict]:
    captured = server.take()
    version = _version(dist)
    if len(captured) == 1:
        return [{"client": client, "version": version, **captured[0]}]
    return [{"client": f"{client} ({i + 1} of {len(captured)})", "version": version, **c}
            for i, c in enumerate(captured)]


# ---- langchain-openai ---------------------------------------------------------------


def langchain_bodies(server: CaptureServer) -> list[dict]:
    import pydantic
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI, OpenAI

    class City(pydantic.BaseModel):
        """A city and its country."""

        city: str
        country: str

    @tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "21 C"

    def chat(**kw: Any) -> ChatOpenAI:
        return ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="x",
                          max_retries=0, **kw)

    out: list[dict] = []
    dist = "langchain-openai"
    chat(max_tokens=4).invoke(QUESTION)
    out += _named(server, "langchain-openai invoke", dist)
    chat(max_tokens=4, temperature=0.7).invoke(
        [("system", "Be brief."), ("human", QUESTION)], stop=["\n"])
    out += _named(server, "langchain-openai invoke temperature+stop", dist)
    chat(max_tokens=4, temperature=0.7, top_p=0.9, seed=1, frequency_penalty=0.1,
         presence_penalty=0.1, n=1, logprobs=True, top_logprobs=2).invoke(QUESTION)
    out += _named(server, "langchain-openai invoke sampling params", dist)
    list(chat(max_tokens=4).stream(QUESTION))
    out += _named(server, "langchain-openai stream", dist)
    list(chat(max_tokens=4, stream_usage=True).stream(QUESTION))
    out += _named(server, "langchain-openai stream stream_usage", dist)

    # a tool loop: the model calls the tool, the result goes back
    llm = chat(max_tokens=32).bind_tools([get_weather])
    history: list[Any] = [HumanMessage(QUESTION)]
    server.replies = [_tool_call("get_weather", '{"city": "Paris"}')]
    ai = llm.invoke(history)
    history += [ai, ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]),
                                tool_call_id=ai.tool_calls[0]["id"])]
    llm.invoke(history)
    out += _named(server, "langchain-openai tool loop", dist)
    server.replies = [_tool_call("get_weather", '{"city": "Paris"}')]
    chat(max_tokens=32).bind_tools([get_weather], tool_choice="get_weather").invoke(QUESTION)
    out += _named(server, "langchain-openai bind_tools tool_choice", dist)
    server.replies = [_tool_call("get_weather", '{"city": "Paris"}')]
    chat(max_tokens=32).bind_tools([get_weather], tool_choice="any").invoke(QUESTION)
    out += _named(server, "langchain-openai bind_tools any", dist)
    server.replies = [_tool_call("get_weather", '{"city": "Paris"}')]
    list(chat(max_tokens=32).bind_tools([get_weather], tool_choice="get_weather")
         .stream(QUESTION))
    out += _named(server, "langchain-openai stream tools", dist)

    prompt = "Where is the Eiffel tower?"
    server.replies = [_text(CITY_JSON)]
    chat(max_tokens=40).with_structured_output(City).invoke(prompt)
    out += _named(server, "langchain-openai with_structured_output", dist)
    server.replies = [_tool_call("City", CITY_JSON)]
    chat(max_tokens=40).with_structured_output(City, method="function_calling").invoke(prompt)
    out += _named(server, "langchain-openai with_structured_output function_calling", dist)
    server.replies = [_text(CITY_JSON)]
    chat(max_tokens=40).with_structured_output(City, method="json_schema").invoke(prompt)
    out += _named(server, "langchain-openai with_structured_output json_schema", dist)
    server.replies = [_text(CITY_JSON)]
    chat(max_tokens=40).with_structured_output(City, method="json_mode").invoke(
        prompt + " Reply in JSON with keys city and country.")
    out += _named(server, "langchain-openai with_structured_output json_mode", dist)

    OpenAI(model=MODEL, base_url=server.url + "/v1", api_key="x", max_retries=0,
           max_tokens=4).invoke("Hello, my name is")
    out += _named(server, "langchain-openai OpenAI (completions)", dist)
    list(OpenAI(model=MODEL, base_url=server.url + "/v1", api_key="x", max_retries=0,
                max_tokens=4).stream("Hello, my name is"))
    out += _named(server, "langchain-openai OpenAI (completions) stream", dist)
    return out


# ---- instructor ---------------------------------------------------------------------


def instructor_bodies(server: CaptureServer) -> list[dict]:
    import instructor
    import pydantic
    from openai import OpenAI

    class City(pydantic.BaseModel):
        city: str
        country: str

    def client(mode: Any) -> Any:
        return instructor.from_openai(OpenAI(base_url=server.url + "/v1", api_key="x",
                                             max_retries=0), mode=mode)

    messages = [{"role": "user", "content": "Where is the Eiffel tower?"}]
    out: list[dict] = []
    dist = "instructor"
    server.replies = [_tool_call("City", CITY_JSON)]
    client(instructor.Mode.TOOLS).chat.completions.create(
        model=MODEL, messages=messages, response_model=City, max_tokens=40, max_retries=0)
    out += _named(server, "instructor tools", dist)
    # the first reply lacks `country`: instructor sends the validation error back
    server.replies = [_tool_call("City", '{"city": "Paris"}'), _tool_call("City", CITY_JSON,
                                                                           "call_2")]
    client(instructor.Mode.TOOLS).chat.completions.create(
        model=MODEL, messages=messages, response_model=City, max_tokens=40, max_retries=1)
    out += _named(server, "instructor tools retry", dist)
    server.replies = [_text(CITY_JSON)]
    client(instructor.Mode.JSON_SCHEMA).chat.completions.create(
        model=MODEL, messages=messages, response_model=City, max_tokens=40, max_retries=0)
    out += _named(server, "instructor json_schema", dist)
    server.replies = [_text('{"city": "Paris"}'), _text(CITY_JSON)]
    client(instructor.Mode.JSON).chat.completions.create(
        model=MODEL, messages=messages, response_model=City, max_tokens=40, max_retries=1)
    out += _named(server, "instructor json retry", dist)
    server.replies = [_tool_call("City", CITY_JSON)]
    list(client(instructor.Mode.TOOLS).chat.completions.create_partial(
        model=MODEL, messages=messages, response_model=City, max_tokens=40, max_retries=0))
    out += _named(server, "instructor tools create_partial", dist)
    server.replies = [_text(CITY_JSON)]
    list(client(instructor.Mode.JSON).chat.completions.create_partial(
        model=MODEL, messages=messages, response_model=City, max_tokens=40, max_retries=0))
    out += _named(server, "instructor json create_partial", dist)
    server.replies = [_text(CITY_JSON)]
    client(instructor.Mode.MD_JSON).chat.completions.create(
        model=MODEL, messages=messages, response_model=City, max_tokens=40, max_retries=0)
    out += _named(server, "instructor md_json", dist)
    return out


# ---- guidellm -----------------------------------------------------------------------


def guidellm_bodies(server: CaptureServer, tokenizer: str) -> list[dict]:
    """`guidellm run` itself (its data pipeline builds the requests), one request
    per format, on synthetic data of 16 prompt and 4 output tokens."""
    out: list[dict] = []
    for fmt, name in (("/v1/completions", "text"), ("/v1/chat/completions", "chat")):
        backend = f"kind=openai_http,target={server.url},model={MODEL},request_format={fmt}"
        cmd = [sys.executable, "-m", "guidellm", "run", "--backend", backend,
               "--profile", "kind=synchronous",
               "--constraint", "kind=max_requests,count=2",
               "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=4",
               "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
               "--output", "kind=console",
               "--disable-console-interactive"]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
        captured = server.take()
        if done.returncode != 0 or not captured:
            raise RuntimeError(f"guidellm run failed ({done.returncode}):\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        out.append({"client": f"guidellm {name}", "version": _version("guidellm"),
                    **captured[0]})
    return out


def merge(captured: list[dict]) -> list[dict]:
    """The JSON file with the OWNED entries replaced by `captured`, where they stood."""
    old = json.loads(OUT.read_text()) if OUT.exists() else []
    kept = [e for e in old if not e["client"].startswith(OWNED)]
    at = next((i for i, e in enumerate(old) if e["client"].startswith(OWNED)), len(old))
    return kept[:at] + captured + kept[at:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="a tokenizer directory, for guidellm")
    args = ap.parse_args()
    server = CaptureServer()
    try:
        captured = langchain_bodies(server) + instructor_bodies(server)
        captured += guidellm_bodies(server, args.tokenizer)
    finally:
        server.shutdown()
        server.server_close()
    bodies = merge(captured)
    OUT.write_text(json.dumps(bodies, indent=1) + "\n")
    print(f"captured {len(captured)} bodies; {len(bodies)} in {OUT}")


if __name__ == "__main__":
    main()
