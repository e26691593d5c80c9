"""KV bytes per sequence by attention type (kvcache/attention_groups.py), as /server_info
and the start-up log report them for Gemma 3 270M: 3 of 18 layers global."""

from __future__ import annotations

from tokenmill.config import ModelConfig
from tokenmill.kvcache.attention_groups import attention_groups


def _gemma_270m() -> ModelConfig:
    return ModelConfig.from_hf_dict({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
        "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "sliding_window": 512, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256})


def test_gemma3_270m_layers_and_bytes_per_sequence():
    cfg = _gemma_270m()
    assert [cfg.layer_window(i) for i in (0, 4, 5, 11, 17)] == [512, 512, None, None, None]
    block_size = 16
    per_block = 2 * 18 * block_size * 1 * 256 * 2  # K and V, bf16, every layer
    groups = attention_groups(cfg, per_block, block_size)
    assert (groups.num_global_layers, groups.num_sliding_layers) == (3, 15)
    info = groups.describe(4096)
    assert info["kv_bytes_per_sequence"] == 18 * 4096 * 1024  # 72 MiB: every layer holds all
    assert info["kv_bytes_per_sequence_if_windowed"] == (3 * 4096 + 15 * 512) * 1024
    assert info["sliding_blocks_freed"] is False
    assert [g["num_layers"] for g in info["kv_cache_groups"]] == [3, 15]


def test_a_model_without_windows_has_one_group():
    cfg = ModelConfig("LlamaForCausalLM", 100, 64, 128, 4, 4, 2, 16)
    info = attention_groups(cfg, 2 * 4 * 16 * 2 * 16 * 2, 16).describe(128)
    assert info["sliding_window"] is None and len(info["kv_cache_groups"]) == 1
    assert info["kv_bytes_per_sequence"] == info["kv_bytes_per_sequence_if_windowed"]
