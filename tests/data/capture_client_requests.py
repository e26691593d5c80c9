"""Writes tests/data/client_requests.json: request bodies as real clients send them.

- openai (the SDK installed here): captured off the wire with an httpx mock
  transport, for the calls agent frameworks make (create, stream, tools, parse).
- lm-eval (installed here): its own `_create_payload` for generate_until and
  loglikelihood, local-completions and local-chat-completions.
- langchain-openai, instructor, guidellm: captured off the wire by
  capture_client_requests_frameworks.py (run with a venv that has them);
  `vllm bench serve` by capture_vllm_bench_requests.py (run with vLLM's own venv);
  vllm-router's forwarded bodies by capture_router_requests.py. This script keeps
  their entries as they are in the file.

Run: PYTHONPATH=. python tests/data/capture_client_requests.py
"""

from __future__ import annotations

import contextlib
import json
import types
from pathlib import Path

import httpx
import openai
import pydantic

MODEL = "smollm2-135m"
OUT = Path(__file__).with_name("client_requests.json")
_CHAT_REPLY = {"id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
               "choices": [{"index": 0, "finish_reason": "stop", "message": {
                   "role": "assistant", "content": '{"city": "Paris", "country": "France"}'}}],
               "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"]}}}


class City(pydantic.BaseModel):
    city: str
    country: str


def openai_sdk_bodies() -> list[dict]:
    captured: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        captured.append({"path": request.url.path, "body": json.loads(request.content)})
        return httpx.Response(200, json=_CHAT_REPLY)

    client = openai.OpenAI(base_url="http://capture/v1", api_key="x", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = client.chat.completions
    chat.create(model=MODEL, messages=msgs, max_tokens=4)
    chat.create(model=MODEL, messages=msgs, max_completion_tokens=4, temperature=0.7, top_p=0.9,
                n=2, stop=["\n"], seed=1, presence_penalty=0.1, frequency_penalty=0.1,
                logprobs=True, top_logprobs=2, user="u-1", metadata={"app": "t"}, store=False,
                service_tier="auto", logit_bias={"42": -5})
    with contextlib.suppress(Exception):  # streamed: the body matters, the reply is not SSE
        list(chat.create(model=MODEL, messages=msgs, max_tokens=4, stream=True,
                         stream_options={"include_usage": True}))
    chat.create(model=MODEL, messages=msgs, max_tokens=8, tools=[WEATHER], tool_choice="required",
                parallel_tool_calls=False)
    chat.create(model=MODEL, messages=msgs, max_tokens=8,
                response_format={"type": "json_object"})
    chat.parse(model=MODEL, messages=msgs, max_tokens=30, response_format=City)
    chat.create(model=MODEL, messages=msgs, max_tokens=4, temperature=None, top_p=None, stop=None,
                seed=None, n=None)  # explicit None: the SDK sends null
    with contextlib.suppress(Exception):  # the chat reply does not parse as a completion
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, echo=False,
                                  logprobs=None, suffix=None, best_of=1)
    return [dict(client="openai-sdk", **c) for c in captured]


def lm_eval_bodies() -> list[dict]:
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    me = types.SimpleNamespace(model=MODEL, _max_gen_toks=4)
    gen = LocalCompletionsAPI._create_payload(me, ["Question: 2+2?\nAnswer:"], generate=True,
                                              gen_kwargs={"until": ["\n\n"], "max_gen_toks": 4,
                                                          "do_sample": False}, eos="<|im_end|>")
    ll = LocalCompletionsAPI._create_payload(me, [[1, 504, 3458, 314]], generate=False)
    chat = LocalChatCompletion._create_payload(me, [{"role": "user", "content": "2+2?"}],
                                               generate=True, gen_kwargs={"until": ["\n"]},
                                               eos="<|im_end|>")
    return [{"client": "lm-eval generate_until", "path": "/v1/completions", "body": gen},
            {"client": "lm-eval loglikelihood", "path": "/v1/completions", "body": ll,
             "needs": "echo"},
            {"client": "lm-eval chat", "path": "/v1/chat/completions", "body": chat}]


def main() -> None:
    captured = openai_sdk_bodies() + lm_eval_bodies()
    ours = {b["client"].split(" ")[0] for b in captured}
    old = json.loads(OUT.read_text()) if OUT.exists() else []
    # the other scripts' entries (frameworks, vllm bench serve, vllm-router) are kept
    others = [e for e in old if e["client"].split(" ")[0] not in ours]
    bodies = captured + others
    OUT.write_text(json.dumps(bodies, indent=1) + "\n")
    print(f"wrote {len(bodies)} bodies to {OUT}")


if __name__ == "__main__":
    main()
