"""Tiny random Qwen3-MoE and Mixtral checkpoints against transformers, fp32: logits of
a forward, and 32 greedy tokens through the engine with chunked prefill, preemption
and prefix-cache hits (the routed experts must not depend on how a step is cut)."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from tests.engine.conftest import assert_no_leak
from tokenmill import LLM, SamplingParams
from tokenmill.loaders import load_model
from tokenmill.models.moe import MoeForCausalLM, SparseMoeBlock

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("shape", ["qwen3moe-8x2", "qwen3moe-128x8", "qwen3moe-nonorm-dense0",
                                   "mixtral-8x2"])
def test_logits_match_transformers(moe_checkpoint, shape):
    path, hf_model = moe_checkpoint(shape)
    loaded = load_model(path)
    model = loaded.model
    assert isinstance(model, MoeForCausalLM) and loaded.dtype == torch.float32
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == ([False, True] if "dense0" in shape else [True, True])
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
        got = model.compute_logits(model(ids, torch.arange(40)))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def _hf_greedy(hf_model, prompt: list[int], n: int = 32) -> list[int]:
    """transformers' greedy tokens with its KV cache, never stopping at EOS (ignore_eos)."""
    saved = hf_model.generation_config.eos_token_id
    hf_model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                    pad_token_id=0)
    finally:
        hf_model.generation_config.eos_token_id = saved
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


def _engine_prompts() -> list[list[int]]:
    """Six prompts of 20-90 tokens, four of them sharing a 48-token prefix (3 blocks)."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 256) for _ in range(48)]
    tails = [[rng.randrange(3, 256) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    alone = [[rng.randrange(3, 256) for _ in range(n)] for n in (20, 90)]
    return [prefix + t for t in tails] + alone


def write_tokenizer(path) -> None:
    """SmolLM2's tokenizer beside the checkpoint: the engine wants one; prompts are ids."""
    from tokenmill.loaders import load_tokenizer, resolve_model

    load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(path)


def run_engine_greedy(model: str, prompts: list[list[int]]) -> tuple[list[list[int]], LLM]:
    """32 greedy tokens per prompt on a cache of 20 blocks x 16 (six prompts need ~45:
    preemption), 32-token steps (every prompt prefilled in chunks), prefix caching on;
    then the shared-prefix prompts again, now hitting the prefix cache."""
    llm = LLM(model, dtype="float32", num_kv_blocks=20, max_num_seqs=6,
              max_num_batched_tokens=32, enable_prefix_caching=True)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions >= 1, "the test meant to preempt"
    assert_no_leak(llm.engine)
    hits_before = stats.prefix_cache_hits
    again = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert llm.engine.get_stats().prefix_cache_hits > hits_before
    assert all(o.num_cached_tokens >= 48 for o in again)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[:2]]
    assert_no_leak(llm.engine)
    return [o.outputs[0].token_ids for o in outs], llm


def test_engine_greedy_matches_transformers(moe_checkpoint, caplog):
    """Qwen3-MoE here; Mixtral takes the same path from a K-quant GGUF (test_moe_gguf.py)."""
    path, hf_model = moe_checkpoint("qwen3moe-8x2")
    write_tokenizer(path)
    prompts = _engine_prompts()
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.runner.fused_decode"):
        got, llm = run_engine_greedy(str(path), prompts)
    assert llm.engine.get_stats().moe_expert_bytes > 0  # explain's measured side
    assert caplog.text.count("MoE model: decode runs the module path") == 1
    expected = [_hf_greedy(hf_model, p) for p in prompts]
    assert got == expected


def test_only_routed_experts_are_read_and_counted():
    """A decode token reads its k experts; experts nobody chose are never touched (NaN
    weights there would poison the output) and the traffic counts k experts' bytes."""
    from tokenmill.models.moe_compute import ExpertTraffic, grouped_experts, route

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, generator=g)
    w13, w2 = torch.randn(8, 24, 16, generator=g), torch.randn(8, 16, 12, generator=g)
    weights, ids = route(torch.randn(1, 8, generator=g), 2, True)
    unused = [e for e in range(8) if e not in ids[0].tolist()]
    w13[unused], w2[unused] = float("nan"), float("nan")
    traffic = ExpertTraffic()
    out = grouped_experts(x, w13, w2, weights, ids, traffic)
    assert torch.isfinite(out).all()
    assert traffic.expert_reads == 2 and traffic.bytes_read == 2 * (w13[0].nbytes + w2[0].nbytes)
