"""oneDNN's per-shape caches are bounded (engine/runner/onednn_caches.py): a server
seeing a new prompt length every step stops growing once the caches are full,
instead of keeping ~2 MiB of compiled code per shape up to 1,024 shapes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from tokenmill.engine.runner import onednn_caches

# one bf16 projection at 60 token counts; prints the RSS it added (MiB)
_SHAPES = r"""
import sys
from tokenmill.engine.runner.onednn_caches import bound_onednn_caches
bound_onednn_caches(int(sys.argv[1]))
import torch
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
torch.set_num_threads(1)
w = torch.randn(1536, 576).bfloat16()
def linear(m):
    return torch.ops.mkldnn._linear_pointwise(torch.randn(m, 576).bfloat16(), w, None,
                                              "none", [], "")
try:
    linear(24)
except (RuntimeError, AttributeError) as e:
    print("unsupported", e)
    sys.exit(0)
before = rss()
for m in range(25, 85):
    linear(m)
print(rss() - before)
"""


def _growth(capacity: int) -> float | None:
    env = {k: v for k, v in os.environ.items() if k not in onednn_caches.ENV_VARS}
    out = subprocess.run([sys.executable, "-c", _SHAPES, str(capacity)], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    last = out.strip().splitlines()[-1]
    return None if last.startswith("unsupported") else float(last)


def test_new_shapes_stop_adding_memory_once_the_caches_are_full():
    capped, libraries_default = _growth(8), _growth(1024)
    if capped is None or libraries_default is None:
        pytest.skip("no oneDNN bf16 linear on this CPU/torch")
    assert libraries_default > 10  # 60 shapes, each its own compiled code
    assert capped < libraries_default / 2


def test_a_capacity_the_user_exported_wins(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "2048")
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    assert onednn_caches.bound_onednn_caches() == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "2048",
        "LRU_CACHE_CAPACITY": str(onednn_caches.DEFAULT_CAPACITY)}


# a server-sized engine (64 tokens a step) whose packed matmuls compile "now" (the
# offline engine's way, before it returns) or "background" (a server's: on another thread
# once it answers, waited for here by its state, as /server_info says it); prompts of many
# lengths; prints the compile's state, then the oneDNN primitives compiled during
# generation (cache misses)
_SERVE = r"""
import json, logging, random, sys
logging.basicConfig(level=logging.INFO)
import torch
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.engine.core.llm_engine import LLMEngine
from tokenmill.engine.core.server_info import server_info
from tokenmill.sampling_params import SamplingParams
background = sys.argv[1] == "background"
engine = LLMEngine(EngineConfig(model="smollm2-135m", max_num_batched_tokens=64,
                                max_num_seqs=8, cache=CacheConfig(kv_cache_memory_bytes=64 << 20)),
                   precompile_now=not background)
if background:
    engine.precompile.start()
    assert engine.precompile.wait(240)
print("precompile", json.dumps(server_info(engine)["onednn_precompile"]), flush=True)
rng = random.Random(0)
params = SamplingParams(max_tokens=3, ignore_eos=True)
for i, n in enumerate((5, 19, 23, 40, 57, 64, 90, 130)):
    engine.add_request(str(i), [rng.randrange(100, 40000) for _ in range(n)], params)
with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
    while engine.has_unfinished_requests():
        engine.step()
"""


def _misses(capacity: str, when: str) -> tuple[int, dict, str]:
    """(cache misses during generation, the compile's /server_info entry, the log)."""
    env = {k: v for k, v in os.environ.items() if k not in onednn_caches.ENV_VARS}
    env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = capacity
    run = subprocess.run([sys.executable, "-c", _SERVE, when], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    state = next(json.loads(line.removeprefix("precompile "))
                 for line in run.stdout.splitlines() if line.startswith("precompile "))
    return run.stdout.count("create:cache_miss"), state, run.stderr


@pytest.mark.parametrize("when", ["now", "background"])
def test_an_engine_compiles_its_packed_matmuls_before_load_not_under_it(when):
    """Every bucketed row count of every packed weight is compiled before the steps,
    so load adds no oneDNN code (the soak's RSS stays flat) and no request waits for a
    compile. In the background that needs the compile thread to run at the steps'
    intra-op thread count, which is part of oneDNN's cache key."""
    misses, state, log = _misses("128", when)
    if state["why"] == "no packed large-batch linears":
        pytest.skip("no packed bf16/fp32 linears on this CPU/torch")
    assert state["state"] == "done" and state["shapes"] > 0 and state["seconds"] > 0
    where = "at start-up" if when == "now" else "in the background"
    assert f"{state['shapes']} oneDNN shapes compiled {where}" in log
    assert misses == 0


def test_packed_matmuls_that_would_not_fit_the_caches_compile_at_first_use():
    misses, state, log = _misses("8", "background")
    if state["why"] == "no packed large-batch linears":
        pytest.skip("no packed bf16/fp32 linears on this CPU/torch")
    assert state["state"] == "skipped" and "would not fit the caches' 8 entries" in state["why"]
    assert "compiled at first use" in log
    assert misses > 0


class _BrokenWeight:
    in_features, dtype = 16, torch.float32

    def __call__(self, x):
        raise RuntimeError("oneDNN said no")


def test_a_failed_background_compile_is_logged_and_leaves_first_use(caplog):
    precompile = onednn_caches.PackedPrecompile({(16, 16, torch.float32): (_BrokenWeight(), [8])})
    assert precompile.describe()["state"] == "pending"
    with caplog.at_level(logging.ERROR):
        precompile.start()
        assert precompile.wait(30)
    info = precompile.describe()
    assert info["state"] == "failed" and info["why"] == "RuntimeError: oneDNN said no"
    assert "compile in the background failed" in caplog.text and "oneDNN said no" in caplog.text
    precompile.run()  # once only: a failed compile is not retried on the engine's thread
    assert precompile.describe()["state"] == "failed"
