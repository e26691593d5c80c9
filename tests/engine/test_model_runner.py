"""The model runner's KV pools: allocated empty, zeroed block by block on first use."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenmill.config import ModelConfig
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.scheduler import ScheduledSeq
from tokenmill.engine.sequence import Sequence
from tokenmill.sampling_params import SamplingParams


def test_blocks_a_step_uses_are_zeroed_before_attention_reads_them():
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=8,
                         intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=4)
    layers = [SimpleNamespace(), SimpleNamespace()]
    model = SimpleNamespace(attention_layers=lambda: layers)
    runner = ModelRunner(model, config, block_size=4, num_blocks=8, kv_dtype=torch.float32,
                         device=torch.device("cpu"))
    for k, v in runner.kv_caches:  # what fresh memory may hold; (kv_heads, blocks, ...)
        k[:, 1:].fill_(float("nan"))
        v[:, 1:].fill_(float("nan"))
    seq = Sequence("r", list(range(6)), SamplingParams())
    seq.block_table = [5, 2]  # 6 tokens: block 5 full, block 2 half
    runner.prepare([ScheduledSeq(seq, 6, True)])
    for k, v in runner.kv_caches:
        for cache in (k, v):
            assert torch.equal(cache[:, [0, 2, 5]], torch.zeros_like(cache[:, [0, 2, 5]]))
            assert torch.isnan(cache[:, [1, 3, 4, 6, 7]]).all()  # untouched: no RSS cost
    k, _ = runner.kv_caches[0]
    k[:, 5, 0] = 1.0  # written K/V is never zeroed again by a later step
    seq.num_computed_tokens = 6
    seq.token_ids.append(7)
    runner.prepare([ScheduledSeq(seq, 1, True)])
    assert k[:, 5, 0].eq(1.0).all()
