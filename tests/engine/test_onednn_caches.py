"""oneDNN's per-shape caches are bounded (engine/runner/onednn_caches.py): a server
seeing a new prompt length every step stops growing once the caches are full,
instead of keeping ~2 MiB of compiled code per shape up to 1,024 shapes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


# a server-sized engine (64 tokens a step); prompts of many lengths; prints the oneDNN
# primitives compiled during generation (cache misses) and the precompile's count
_SERVE = r"""
import logging, random, sys
logging.basicConfig(level=logging.INFO)
import torch
from tokenmill import LLM, SamplingParams
llm = LLM(model="smollm2-135m", max_num_batched_tokens=64, max_num_seqs=8,
          kv_cache_memory=64 << 20)
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 19, 23, 40, 57, 64, 90, 130)]
with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
    llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
"""


def _misses(capacity: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k not in onednn_caches.ENV_VARS}
    env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = capacity
    run = subprocess.run([sys.executable, "-c", _SERVE], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    return run.stdout.count("create:cache_miss"), run.stderr


def test_a_server_compiles_its_packed_matmuls_at_start_up_not_under_load():
    """Every bucketed row count of every packed weight is compiled while the engine
    starts, so load adds no oneDNN code (the soak's RSS stays flat) and no request
    waits for a compile; with caches too small to hold them all, it is not tried."""
    misses, log = _misses("128")
    if "no packed large-batch linears" in log:
        pytest.skip("no packed bf16/fp32 linears on this CPU/torch")
    assert "oneDNN shapes compiled at start-up" in log
    assert misses == 0
    misses, log = _misses("8")  # the shapes would not fit: compiled at first use
    assert "would not fit the caches' 8 entries" in log
    assert misses > 0
