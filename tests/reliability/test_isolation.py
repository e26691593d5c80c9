"""Cross-request isolation under the features that reorder work (issue 64; vLLM's
GHSA-v97p-wpxp-px84 leaked tokens between requests under async scheduling):
64 concurrent requests with distinct prompts and seeds, mixing greedy and seeded
sampling, n = 2, logprobs and structured output, under async scheduling, ngram
speculation, prefix caching with preemption (a KV pool far too small for the
batch) and two tensor-parallel ranks, each its own engine.

Two assertions that do not lean on each other:
- float32: each request's tokens (and logprobs) equal its run alone on the same
  engine; greedy on the fp32 path is batch-invariant (tests/engine/test_engine.py)
  and seeded sampling draws from the request's own generator;
- bfloat16: each request may only sample from its own disjoint
  `allowed_token_ids` set, so a token outside it is a leak whatever the numerics;
  the structured-output requests beside them must still match their regex.
"""

from __future__ import annotations

import functools
import os
import random
import re

import pytest

from tests.engine.conftest import assert_no_leak
from tests.speculative.conftest import make_llm, write_tiny_llama
from tokenmill import SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

N_REQUESTS = 64
MAX_TOKENS = 10
REGEX = "[a-z]{2,6}-[0-9]{2}"
SET_SIZE = 16
SET_BASE = 1000  # token ids of request i's allowed set: SET_BASE + SET_SIZE * i + [0, 16)

CONFIGS = {
    "async": {"async_scheduling": True},
    # spec_max_batch: speculate with all 80 sequences running (by default only at 8 or fewer)
    "ngram": {"speculative": "ngram", "num_speculative_tokens": 3, "spec_max_batch": 256},
    # 64 sequences of ~50 tokens need ~200 blocks of 16; 40 forces preemption
    "prefix_preempt": {"enable_prefix_caching": True, "num_kv_blocks": 40},
    "tp2": {"tensor_parallel_size": 2},
}
COMMON = {"max_num_seqs": N_REQUESTS, "max_num_batched_tokens": 512}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_tiny_llama(tmp_path_factory.mktemp("isolation-llama"), num_layers=2)


def _base_prompts() -> list[list[int]]:
    """Distinct prompts; groups of 8 share a 32-token prefix (prefix caching hits)."""
    rng = random.Random(64)
    prefixes = [[rng.randrange(3000, 40000) for _ in range(32)] for _ in range(N_REQUESTS // 8)]
    return [prefixes[i // 8] + [rng.randrange(3000, 40000) for _ in range(rng.randrange(2, 12))]
            for i in range(N_REQUESTS)]


@functools.cache
def _prompts(tiny: str, dtype: str) -> list[list[int]]:
    """Each base prompt, its own greedy continuation (at `dtype`), a few other tokens,
    and its last token again: the model tends to go on as it did the first time, so
    the ngram proposer finds drafts, some of them accepted."""
    base = _base_prompts()
    llm = make_llm(tiny, dtype=dtype, **COMMON)
    try:
        outs = llm.generate(base, SamplingParams(temperature=0.0, max_tokens=8,
                                                 ignore_eos=True), use_tqdm=False)
    finally:
        llm.engine.close()
    rng = random.Random(65)
    return [p + list(o.outputs[0].token_ids) + [rng.randrange(3000, 40000) for _ in range(3)]
            + p[-1:] for p, o in zip(base, outs, strict=True)]


def _params(i: int, allowed: bool) -> SamplingParams:
    kind = i % 4
    common = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
    if allowed and kind in (1, 2):  # 0 and 3 run beside them unconstrained (0 speculates)
        common["allowed_token_ids"] = list(range(SET_BASE + SET_SIZE * i,
                                                 SET_BASE + SET_SIZE * (i + 1)))
    if kind == 0:
        return SamplingParams(temperature=0.0, logprobs=2, **common)
    if kind == 1:
        return SamplingParams(temperature=0.9, seed=1000 + i, n=2, **common)
    if kind == 2:
        return SamplingParams(temperature=0.7, top_k=50, seed=2000 + i, logprobs=1, **common)
    return SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(
        regex=REGEX), max_tokens=MAX_TOKENS)


def _key(out) -> list:
    """Tokens and logprob candidates exactly; logprob values separately (_close)."""
    return [(o.index, list(o.token_ids), [sorted(step) for step in (o.logprobs or [])])
            for o in out.outputs]


def _close(a, b) -> bool:
    """Logprobs within 1e-3: fp32 sums in another batch shape differ in the last bits."""
    for x, y in zip(a.outputs, b.outputs, strict=True):
        for sx, sy in zip(x.logprobs or [], y.logprobs or [], strict=True):
            if any(abs(sx[t].logprob - sy[t].logprob) > 1e-3 for t in sx):
                return False
    return True


# tp2 in `make test` hung once in gloo's process-group creation (rank 0 in this process
# and its worker both waiting in ProcessGroupGloo's constructor, 2026-12-06, after the
# three other configurations ran in the same process); until that is understood it runs
# on request: TOKENMILL_TEST_TP_INPROCESS=1. TP=2 = TP=1 in float32 stays covered by
# tests/distributed/test_tensor_parallel.py.
_TP_ISOLATION = os.environ.get("TOKENMILL_TEST_TP_INPROCESS") == "1"
_CONFIG_PARAMS = [
    pytest.param(n, marks=[pytest.mark.slow, pytest.mark.skipif(
        not _TP_ISOLATION, reason="set TOKENMILL_TEST_TP_INPROCESS=1 (a gloo init hang)")])
    if n == "tp2" else n for n in CONFIGS]


def _make(tiny: str, dtype: str, name: str):
    llm = make_llm(tiny, dtype=dtype, **COMMON, **CONFIGS[name])
    if name == "ngram":  # always propose k drafts, whatever the measured step cost
        llm.engine.speculator.adaptive = False
    return llm


def _check_features_ran(name: str, stats) -> None:
    if name == "async":
        assert stats.num_async_steps > 0
    elif name == "ngram":  # drafts proposed and verified (a random model rejects most)
        assert stats.spec_proposed_tokens > 0 and stats.spec_verified_steps > 0
    elif name == "prefix_preempt":
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


@functools.cache
def _alone(tiny: str) -> list:
    """Each request run alone on a plain fp32 engine: the reference every
    configuration's batch must reproduce."""
    llm = make_llm(tiny, dtype="float32", **COMMON)
    try:
        return [llm.generate([prompt], [_params(i, allowed=False)], use_tqdm=False)[0]
                for i, prompt in enumerate(_prompts(tiny, "float32"))]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("name", _CONFIG_PARAMS)
def test_each_request_gets_its_tokens_alone_under_float32(tiny, name):
    alone = _alone(tiny)
    llm = _make(tiny, "float32", name)
    try:
        params = [_params(i, allowed=False) for i in range(N_REQUESTS)]
        together = llm.generate(_prompts(tiny, "float32"), params, use_tqdm=False)
        _check_features_ran(name, llm.engine.get_stats())
        for i in range(N_REQUESTS):
            if name == "ngram" and params[i].temperature > 0:
                # a seeded request's draws depend on which of its steps got drafts
                # (rejection sampling), and a step with any prompt chunk in it
                # speculates for no one: batch-dependent by design (docs/serving.md, limits);
                # the leak test below still covers these requests
                continue
            assert _key(together[i]) == _key(alone[i]), f"request {i} ({name}) differs alone"
            assert _close(together[i], alone[i]), f"request {i} ({name}): logprobs differ"
        assert_no_leak(llm.engine)
    finally:
        llm.engine.close()


@pytest.mark.parametrize("name", _CONFIG_PARAMS)
def test_no_request_samples_outside_its_own_allowed_tokens(tiny, name):
    llm = _make(tiny, "bfloat16", name)
    try:
        params = [_params(i, allowed=True) for i in range(N_REQUESTS)]
        outs = llm.generate(_prompts(tiny, "bfloat16"), params, use_tqdm=False)
        _check_features_ran(name, llm.engine.get_stats())
        for i, (out, p) in enumerate(zip(outs, params, strict=True)):
            assert len(out.outputs) == p.n
            for o in out.outputs:
                assert len(o.token_ids) > 0
                if p.structured_outputs is not None:  # the mask pass is shared too
                    assert re.fullmatch(REGEX, o.text), (i, o.text)
                if p.allowed_token_ids is None:
                    continue
                leaked = set(o.token_ids) - set(p.allowed_token_ids)
                assert not leaked, f"request {i} ({name}) sampled {leaked}, outside its set"
        assert_no_leak(llm.engine)
    finally:
        llm.engine.close()
