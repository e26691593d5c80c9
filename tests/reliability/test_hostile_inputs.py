"""Hostile and unlucky inputs, each sent while a stream runs beside them: every
one gets a 4xx with an OpenAI error object (never a 5xx), the stream's chunks
keep coming (no gap over 0.5 s), and no KV block is left in use afterwards."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.reliability.common import BackgroundStream, metric, wait_idle
from tokenmill.server import protocol as p

pytestmark = pytest.mark.slow

C, CHAT, TOK = "/v1/completions", "/v1/chat/completions", "/tokenize"
HI = [{"role": "user", "content": "hi"}]


def _nested(depth: int, open_: bytes, close: bytes) -> bytes:
    return open_ * depth + b"1" + close * depth


# (name, path, JSON body or raw bytes, the param the error names or None)
CASES: list[tuple[str, str, object, str | None]] = [
    ("2 MB prompt string", C, {"prompt": "word " * 400_000}, "prompt"),
    ("100k-token prompt", C, {"prompt": [17] * 100_000, "max_tokens": 1}, None),
    ("10k stop strings", C, {"prompt": "hi", "stop": ["x"] * 10_000}, "stop"),
    ("100 KB stop string", C, {"prompt": "hi", "stop": "x" * 100_000}, "stop"),
    ("stop past its count", C, {"prompt": "hi", "stop": ["x"] * (p.MAX_STOP_SEQUENCES + 1)},
     "stop"),
    ("stop past its length", C, {"prompt": "hi", "stop": "x" * (p.MAX_STOP_CHARS + 1)},
     "stop"),
    ("n=128 x max_tokens 1e9", C, {"prompt": "hi", "n": 128, "max_tokens": 10**9},
     "max_tokens"),
    ("n=128 x what the cache cannot hold", C, {"prompt": "hi", "n": 128, "max_tokens": 2040},
     "max_tokens"),
    ("nested arrays 100k deep", C, b'{"prompt": "hi", "x": ' + _nested(100_000, b"[", b"]")
     + b"}", None),
    ("nested objects 10k deep", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"chat_template_kwargs": ' + _nested(10_000, b'{"a":', b"}") + b"}", None),
    ("invalid UTF-8", C, b'{"prompt": "\xff\xfe\xc3("}', None),
    ("lone surrogate", C, b'{"prompt": "\\ud800"}', "prompt"),
    ("NaN temperature", C, b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("Infinity top_p", C, b'{"prompt": "hi", "top_p": Infinity}', "top_p"),
    ("-Infinity penalty", C, b'{"prompt": "hi", "presence_penalty": -Infinity}',
     "presence_penalty"),
    ("1e400 max_tokens", C, b'{"prompt": "hi", "max_tokens": 1e400}', "max_tokens"),
    ("negative seed", C, {"prompt": "hi", "seed": -1}, "seed"),
    ("seed 2**63", C, {"prompt": "hi", "seed": 2**63}, "seed"),
    ("n 0", C, {"prompt": "hi", "n": 0}, "n"),
    ("n past", C, {"prompt": "hi", "n": p.MAX_N + 1}, "n"),
    ("logprobs past", C, {"prompt": "hi", "logprobs": p.MAX_LOGPROBS + 1}, "logprobs"),
    ("logprobs -1", C, {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("prompt_logprobs past", C, {"prompt": "hi", "prompt_logprobs": p.MAX_LOGPROBS + 1},
     "prompt_logprobs"),
    ("top_logprobs past", CHAT, {"messages": HI, "logprobs": True,
                                 "top_logprobs": p.MAX_LOGPROBS + 1}, "top_logprobs"),
    ("max_tokens -1", C, {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("max_tokens 2**63", C, {"prompt": "hi", "max_tokens": 2**63}, "max_tokens"),
    ("max_tokens past the context", C, {"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
    ("max_completion_tokens 0", CHAT, {"messages": HI, "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("temperature -0.1", C, {"prompt": "hi", "temperature": -0.1}, "temperature"),
    ("top_p 0", C, {"prompt": "hi", "top_p": 0}, "top_p"),
    ("top_p 1.01", C, {"prompt": "hi", "top_p": 1.01}, "top_p"),
    ("top_k -2", C, {"prompt": "hi", "top_k": -2}, "top_k"),
    ("top_k 2**31", C, {"prompt": "hi", "top_k": 2**31}, "top_k"),
    ("min_p 1.01", C, {"prompt": "hi", "min_p": 1.01}, "min_p"),
    ("presence_penalty 2.01", C, {"prompt": "hi", "presence_penalty": 2.01},
     "presence_penalty"),
    ("frequency_penalty -2.01", C, {"prompt": "hi", "frequency_penalty": -2.01},
     "frequency_penalty"),
    ("repetition_penalty 0", C, {"prompt": "hi", "repetition_penalty": 0},
     "repetition_penalty"),
    ("min_tokens -1", C, {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    ("stop token id past the vocabulary", C, {"prompt": "hi", "stop_token_ids": [10**9]},
     "stop_token_ids"),
    ("prompt token id past the vocabulary", C, {"prompt": [10**9]}, "prompt"),
    ("prompt token id -1", C, {"prompt": [-1]}, None),
    ("2049 prompts", C, {"prompt": ["hi"] * 2049}, "prompt"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, None),
    ("no messages", CHAT, {"messages": []}, "messages"),
    ("a message that is not an object", CHAT, {"messages": ["hi"]}, None),
    ("10,000 messages", CHAT, {"messages": HI * 10_000, "max_tokens": 1}, "messages"),
    ("messages past the limit", CHAT, {"messages": HI * (p.MAX_MESSAGES + 1)}, "messages"),
    ("10,000 messages to /tokenize", TOK, {"messages": HI * 10_000}, "messages"),
    ("a body that is a list", C, b"[1, 2, 3]", None),
    ("a body that is not JSON", C, b"{", None),
]


def _send(client: httpx.Client, path: str, body: object) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, json=body)


def test_hostile_inputs_get_4xx_without_stalling_or_leaking(server):
    results, spans = [], []
    with httpx.Client(base_url=server.base_url, timeout=120) as client, \
            BackgroundStream(server.base_url) as stream:
        for name, path, body, param in CASES:
            sent = time.monotonic()
            results.append((name, param, _send(client, path, body)))
            spans.append((name, sent, time.monotonic()))
    bad = []
    for name, param, r in results:
        try:
            error = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            bad.append(f"{name}: {r.status_code} without an error object: {r.text[:200]}")
            continue
        if not 400 <= r.status_code < 500:
            bad.append(f"{name}: {r.status_code} {error}")
        elif not (isinstance(error.get("message"), str) and error.get("type")):
            bad.append(f"{name}: not an OpenAI error object: {error}")
        elif param is not None and (error.get("param") or "").split(".")[0] != param:
            bad.append(f"{name}: param {error.get('param')!r}, expected {param!r}")
    assert not bad, "\n".join(bad)
    gap_s, gap_end = stream.max_gap_in_window()
    during = [name for name, sent, done in spans if sent <= gap_end and done >= gap_end - gap_s]
    assert gap_s <= 0.5, f"a {gap_s:.2f} s gap while {during} were in flight"
    wait_idle(server.base_url)
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_numeric_fields_at_their_bounds_are_accepted(server):
    """The other side of the bounds above: the limits themselves are served."""
    ok_bodies = [
        (C, {"prompt": "hi", "max_tokens": 1, "n": 2, "seed": 0, "temperature": 0,
             "top_p": 1, "top_k": -1, "min_p": 1, "presence_penalty": 2,
             "frequency_penalty": -2, "logprobs": p.MAX_LOGPROBS,
             "stop": ["x" * p.MAX_STOP_CHARS] * p.MAX_STOP_SEQUENCES}),
        (C, {"prompt": "hi", "max_tokens": 1, "seed": 2**63 - 1,
             "prompt_logprobs": p.MAX_LOGPROBS}),
        (CHAT, {"messages": HI * 3, "max_completion_tokens": 1, "logprobs": True,
                "top_logprobs": p.MAX_LOGPROBS}),
        (CHAT, {"messages": [{"role": "user", "content": ""}], "max_tokens": 1}),
    ]
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        for path, body in ok_bodies:
            r = client.post(path, json=body)
            assert r.status_code == 200, (body, r.text[:300])
        r = client.post(TOK, json={"messages": HI * p.MAX_MESSAGES})
        assert r.status_code == 200, r.text[:300]
    wait_idle(server.base_url)
    # the lazily touched pool: some of it committed by now, never more than all of it
    committed = metric(server.base_url, ":kv_cache_committed_bytes")
    assert 0 < committed <= metric(server.base_url, ":kv_cache_pool_bytes")


def test_limits_are_in_the_serving_page():
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    section = page.split("## Limits and failure behaviour", 1)[1].split("\n## ", 1)[0]
    for limit in (p.MAX_N, p.MAX_LOGPROBS, p.MAX_STOP_SEQUENCES, p.MAX_STOP_CHARS,
                  p.MAX_MESSAGES):
        assert str(limit) in section, limit
