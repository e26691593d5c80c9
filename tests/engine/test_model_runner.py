"""The model runner's KV pools: on the CPU zero pages that cost nothing until written;
elsewhere allocated empty and zeroed block by block on first use."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tokenmill.config import ModelConfig
from tokenmill.engine.core.builder import process_rss_bytes
from tokenmill.engine.core.scheduler import ScheduledSeq
from tokenmill.engine.runner.model_runner import ModelRunner
from tokenmill.kvcache import pool as kv_pool
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence


def test_a_cpu_pool_reads_zeros_and_costs_memory_only_where_written():
    before = process_rss_bytes()
    cache = kv_pool.zero_pages((4, 1024, 16, 1024), torch.bfloat16, torch.device("cpu"))
    assert cache.nbytes == 128 << 20
    assert process_rss_bytes() - before < 16 << 20  # nothing resident yet
    assert cache[:, 700].abs().max().item() == 0  # a block never written reads zeros
    cache[:, 3:35] = 1.0  # 32 blocks of 4 heads: 4 MiB
    grown = process_rss_bytes() - before
    assert 4 << 20 <= grown < 24 << 20
    assert cache.data_ptr() % 4096 == 0  # page-aligned, as the vector kernels like it
    cpu_runner = ModelRunner(SimpleNamespace(attention_layers=lambda: [SimpleNamespace()]),
                             tiny_config(1), block_size=4, num_blocks=8,
                             kv_dtype=torch.float32, device=torch.device("cpu"))
    assert cpu_runner.pool.fresh is None  # no block is zeroed by a step


def tiny_config(num_layers: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=8,
                       intermediate_size=16, num_hidden_layers=num_layers,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=4)


def test_blocks_a_step_uses_are_zeroed_before_attention_reads_them(monkeypatch):
    # a device whose fresh memory is not zeros (on the CPU it is: see above)
    monkeypatch.setattr(kv_pool, "allocator", lambda device, zeroed: (torch.empty, False))
    config = tiny_config(2)
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
