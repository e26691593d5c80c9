"""The rare ngram stall (issue 64): "under --speculative ngram with 8 KV blocks, a
preempted sequence was never rescheduled". The scenario it was seen in — two
requests that cannot both fit, the later one preempted — on the embedded SmolLM2,
with every step's progress watched: both finish with every token, the preempted
one recomputed, the KV books exact after every step. And a short randomized mix
(benchmarks/features/spec_stress.py, the long hunt) on the same model: tiny pools,
n > 1, stop strings, aborts, prefix hits — no step loop without progress."""

from __future__ import annotations

import random

import pytest

from benchmarks.features.spec_stress import run_round
from tests.speculative.conftest import assert_no_leak
from tokenmill import SamplingParams
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.engine.core.llm_engine import LLMEngine


def test_preempted_sequence_is_rescheduled_under_ngram():
    engine = LLMEngine(EngineConfig(
        max_num_seqs=2, speculative="ngram", debug_kv_integrity=True,
        cache=CacheConfig(num_kv_blocks=8, enable_prefix_caching=False)), detokenize=False)
    engine.speculator.adaptive = False  # propose whenever ngram matches: no timing in it
    rng = random.Random(8)
    a = [rng.randrange(1000, 40000) for _ in range(8)] * 5  # repeats itself: drafts
    b = [rng.randrange(1000, 40000) for _ in range(10)] * 4
    params = {"a": SamplingParams(max_tokens=70, temperature=0, ignore_eos=True),
              "b": SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)}
    engine.add_request("a", a, params["a"])
    got: dict[str, int] = {}
    finished: set[str] = set()
    calls = 0
    while engine.has_unfinished_requests():
        calls += 1
        assert calls < 400, f"no end after {calls} steps: {got}, {engine.scheduler.waiting}"
        for out in engine.step():
            got[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finished.add(out.request_id)
        if "a" in got and "b" not in got and "b" not in engine.requests:
            engine.add_request("b", b, params["b"])  # once a streams, as the server test
    assert got == {"a": 70, "b": 30} and finished == {"a", "b"}
    assert engine.scheduler.num_preemptions >= 1
    assert engine.speculator.stats.num_accepted_tokens > 0  # speculation was really on
    assert_no_leak(engine)


@pytest.mark.parametrize("seed", [11000, 20004])
def test_randomized_mix_under_ngram_never_stalls(seed):
    """Two rounds of the hunt's mix at fixed configurations (8 and 12 blocks, k 8 and 4,
    prefix caching off and on): run_round raises Stall on a step loop without progress
    and asserts every block back at the end."""
    cfg = {8: {"num_kv_blocks": 8, "max_num_seqs": 16, "max_num_batched_tokens": 256,
               "num_speculative_tokens": 8, "ngram_min": 2, "spec_max_batch": 2,
               "prefix_caching": False, "adaptive": False},
           12: {"num_kv_blocks": 12, "max_num_seqs": 4, "max_num_batched_tokens": 32,
                "num_speculative_tokens": 4, "ngram_min": 1, "spec_max_batch": 8,
                "prefix_caching": True, "adaptive": False}}[8 if seed == 11000 else 12]
    out = run_round(cfg, seed, num_requests=5, stall_steps=200)
    assert out["added"] == 5 and out["steps"] > 0
