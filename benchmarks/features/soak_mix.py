"""The request mix of issue 64's soak, beside soak.py's streamed completions:
non-streamed chat with structured output (a JSON schema), a forced tool call,
n = 2 with logprobs, and prompts behind a shared 200-word prefix (prefix-cache
hits). Each answer is checked for what the feature promises, so a wrong shape
counts as an unexpected outcome, not a success.
"""

from __future__ import annotations

import collections
import json
import random

import httpx

SHARED_PREFIX = " ".join(["You are a careful assistant who answers briefly and exactly."] * 20)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"]}}}


def shared_prefix_prompt(rng: random.Random, words: list[str]) -> str:
    return SHARED_PREFIX + " " + " ".join(rng.choice(words) for _ in range(rng.randint(4, 40)))


async def mixed_request(client: httpx.AsyncClient, rng: random.Random, words: list[str],
                        counts: collections.Counter) -> None:
    kind = rng.choice(("structured", "tools", "n2_logprobs", "shared_prefix"))
    user = " ".join(rng.choice(words) for _ in range(rng.randint(4, 30)))
    if kind == "structured":
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"A person as JSON. {user}"}],
            "max_tokens": 48, "response_format": {"type": "json_schema", "json_schema": {
                "name": "person", "schema": SCHEMA}}})
        ok = r.status_code == 200 and _json_fits(r.json(), r.json().get("choices"))
    elif kind == "tools":
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"Weather? {user}"}],
            "max_tokens": 48, "tools": [TOOL], "tool_choice": "required"})
        choice = r.json()["choices"][0] if r.status_code == 200 else {}
        # a call cut by max_tokens is no call (finish_reason "length"), as for the schema
        ok = r.status_code == 200 and (bool(choice["message"].get("tool_calls"))
                                       or choice.get("finish_reason") == "length")
    elif kind == "n2_logprobs":
        r = await client.post("/v1/completions", json={
            "prompt": user, "max_tokens": rng.randint(8, 48), "n": 2, "logprobs": 2,
            "temperature": 0.9, "seed": rng.randrange(1 << 31)})
        ok = r.status_code == 200 and len(r.json()["choices"]) == 2 and all(
            c["logprobs"]["top_logprobs"] for c in r.json()["choices"])
    else:
        r = await client.post("/v1/completions", json={
            "prompt": shared_prefix_prompt(rng, words), "max_tokens": rng.randint(8, 64),
            "temperature": 0.0})
        ok = r.status_code == 200
    counts[f"{kind}: ok" if ok else f"{kind}: unexpected {r.status_code} {r.text[:100]}"] += 1


def _json_fits(body: dict, choices: list | None) -> bool:
    """A structured answer parses and has the schema's keys (or was cut by max_tokens)."""
    if not choices:
        return False
    choice = choices[0]
    if choice.get("finish_reason") == "length":
        return True  # cut short by max_tokens: valid so far, not a whole object
    try:
        value = json.loads(choice["message"]["content"])
    except (ValueError, TypeError):
        return False
    return isinstance(value, dict) and set(value) == {"name", "age"}
