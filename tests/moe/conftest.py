"""Tiny random Qwen3-MoE and Mixtral checkpoints written by the tests (safetensors and GGUF)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

TINY_MOE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "num_experts_per_tok": 2, "tie_word_embeddings": False}
# (family, overrides): 8 experts top-2 for both; Qwen3-MoE's real 128 / 8 at tiny width
SHAPES = {
    "qwen3moe-8x2": ("qwen3_moe", {"num_experts": 8, "moe_intermediate_size": 32,
                                   "norm_topk_prob": True, "head_dim": 32}),
    "qwen3moe-128x8": ("qwen3_moe", {"num_experts": 128, "num_experts_per_tok": 8,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "qwen3moe-nonorm-dense0": ("qwen3_moe", {"num_experts": 8, "moe_intermediate_size": 32,
                                             "norm_topk_prob": False, "mlp_only_layers": [0]}),
    "mixtral-8x2": ("mixtral", {"num_local_experts": 8, "intermediate_size": 32}),
}


def make_hf_moe(family: str, **overrides: Any) -> torch.nn.Module:
    """A tiny transformers MoE model, every weight random (router and norms too)."""
    import transformers

    config_cls, model_cls = {
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM)}[family]
    config = config_cls(**{**TINY_MOE, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.15)
            if "norm" in name:
                p.add_(1.0)
            if name.endswith("lm_head.weight"):
                p.mul_(4.0)  # peaked next-token distributions: greedy ties stay rare
    return model


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """Factory, cached per shape: name in SHAPES -> (checkpoint dir, transformers model)."""
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in made:
            family, overrides = SHAPES[name]
            model = make_hf_moe(family, **overrides)
            path = tmp_path_factory.mktemp(f"hf-{name}")
            model.save_pretrained(path)
            made[name] = (path, model)
        return made[name]

    return make
