"""--gpu-memory-utilization arithmetic (kvcache/budget.py), with a fake CUDA device."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import CacheConfig, ModelConfig
from tokenmill.kvcache import budget
from tokenmill.kvcache.budget import KVBudgetError, cuda_kv_budget_bytes

GiB = 2**30


def test_kv_cache_gets_utilization_times_total_less_weights_peak_and_graphs():
    assert cuda_kv_budget_bytes(80 * GiB, 16 * GiB, 4 * GiB, 1 * GiB, 0.9) == \
        int(72 * GiB) - 21 * GiB
    assert cuda_kv_budget_bytes(80 * GiB, 16 * GiB, 0, 0, 1.0) == 64 * GiB


def test_weights_that_do_not_fit_are_a_clear_error():
    with pytest.raises(KVBudgetError, match=r"weights alone \(75.00 GiB\) do not fit in 90%"):
        cuda_kv_budget_bytes(80 * GiB, 75 * GiB, 0, 0, 0.9)
    with pytest.raises(KVBudgetError, match="no memory is left for the KV cache"):
        cuda_kv_budget_bytes(80 * GiB, 70 * GiB, 2 * GiB, 0, 0.9)
    with pytest.raises(KVBudgetError, match=r"in \(0, 1\]"):
        cuda_kv_budget_bytes(80 * GiB, 1, 0, 0, 1.5)


def test_choose_num_blocks_on_a_fake_cuda_device(monkeypatch):
    """80 GiB card, 1 GiB held by another process, 16 GiB of weights allocated,
    a profile forward that peaked 4 GiB above them."""
    fake = {"mem_get_info": lambda d: (80 * GiB - 1 * GiB - 16 * GiB, 80 * GiB),
            "memory_allocated": lambda d: 16 * GiB, "memory_reserved": lambda d: 16 * GiB,
            "max_memory_allocated": lambda d: 20 * GiB}
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128)
    per_block = budget.kv_cache_bytes_per_block(config, 16, torch.bfloat16)
    assert per_block == 2 * 32 * 16 * 8 * 128 * 2  # 2 MiB: 128 KiB per token
    num_blocks = budget.choose_num_blocks(config, CacheConfig(), torch.bfloat16,
                                          torch.device("cuda"), 8192, 64, graph_share=0.25)
    expected = int(80 * GiB * 0.9) - 17 * GiB - 4 * GiB - 1 * GiB
    assert num_blocks == expected // per_block
