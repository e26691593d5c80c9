"""The graph-shaped decode closure on CPU (engine/cuda_graph.py): the same static
buffers and padding a CUDA graph replays, run eagerly, give the tokens of the
plain eager path."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import assert_no_leak
from tokenmill import LLM, SamplingParams
from tokenmill.engine.runner.cuda_graph import bucket_sizes

ENGINE = {"dtype": "float32", "attention_backend": "torch", "num_kv_blocks": 64,
          "max_num_seqs": 8, "max_model_len": 256}


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def generate(llm: LLM, batch: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(batch, params, use_tqdm=False)
    assert_no_leak(llm.engine)
    return [o.outputs[0].token_ids for o in outs]


def test_buckets():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(5) == [1, 2, 4, 5]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert bucket_sizes(64)[-3:] == [48, 56, 64]


@pytest.fixture(scope="module")
def eager(tiny_model) -> LLM:
    """Every step built fresh: no static buffers at all."""
    llm = LLM(tiny_model, enforce_eager=True, **ENGINE)
    assert llm.engine.runner.graphs is None
    return llm


@pytest.fixture(scope="module")
def static(tiny_model) -> LLM:
    """One engine for the module: each test finds the buffers the last one left."""
    return LLM(tiny_model, **ENGINE)


def test_batch_of_5_padded_to_8_gives_the_unpadded_tokens(static, eager, monkeypatch):
    llm = static
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.bucket_for(5) == 8
    buckets_run: list[int] = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda meta: buckets_run.append(meta.num_seqs) or run(meta))
    batch = prompts(5, seed=1)
    assert generate(llm, batch, [6] * 5) == generate(eager, batch, [6] * 5)
    assert buckets_run and set(buckets_run) == {8}  # every decode step ran padded


def test_static_buffers_reused_across_batch_sizes_give_fresh_buffers_tokens(static, eager):
    # batch sizes 7 -> 5 -> 2 -> 1 as sequences finish (buckets 8, 8, 2, 1), then a
    # second run of 3 over the stale rows the first left behind
    first, lengths = prompts(7, seed=2), [2, 4, 4, 7, 7, 7, 9]
    second = prompts(3, seed=3)
    got = generate(static, first, lengths) + generate(static, second, [5] * 3)
    assert got == generate(eager, first, lengths) + generate(eager, second, [5] * 3)


def test_greedy_and_seeded_sampling_on_the_static_path_equal_the_eager_path(static, eager):
    """Sampling runs on the static logits buffer where the graph left them."""
    llm = static
    batch = prompts(4, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=12, n=2, max_tokens=5,
                             ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.7, min_p=0.05, seed=13, max_tokens=5,
                             ignore_eos=True)]

    def run(engine: LLM) -> tuple[list, list]:
        outs = engine.generate(batch, params, use_tqdm=False)
        assert_no_leak(engine.engine)
        completions = [c for o in outs for c in o.outputs]
        logprobs = [(t, e.rank, e.logprob) for c in completions for step in c.logprobs or []
                    for t, e in step.items()]
        return [c.token_ids for c in completions], logprobs

    tokens, logprobs = run(llm)
    expected_tokens, expected_logprobs = run(eager)
    assert tokens == expected_tokens
    # a padded batch's matmuls may round in another order: logprobs agree to fp32 noise
    assert [lp[:2] for lp in logprobs] == [lp[:2] for lp in expected_logprobs]
    assert logprobs and all(abs(a[2] - b[2]) < 1e-4 for a, b in zip(logprobs, expected_logprobs))


def test_layerskip_drafts_over_the_padded_metadata(tiny_model, eager):
    """The layer-skip proposer runs the model itself over the runner's decode
    metadata: with the static path it gets the padded bucket's ids, and the
    tokens stay those of the eager engine."""
    spec = {"speculative": "layerskip", "draft_layers": 2, "num_speculative_tokens": 3}
    llm = LLM(tiny_model, **ENGINE, **spec)
    assert llm.engine.runner.graphs is not None
    batch = prompts(3, seed=5)
    assert generate(llm, batch, [8] * 3) == generate(eager, batch, [8] * 3)


def test_flags_reach_the_engine_config():
    import argparse

    from tokenmill.cli.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(
        ["m", "--enforce-eager", "--load-format", "dummy", "--quantization", "fp8"]))
    assert (config.enforce_eager, config.load_format, config.quantization) == (True, "dummy",
                                                                                 "fp8")
    assert not engine_config_from_args(parser.parse_args(["m"])).enforce_eager
