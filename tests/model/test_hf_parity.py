"""Tiny random Llama / Mistral / Qwen2 / Qwen3 checkpoints: tokenmill's logits match transformers'."""

from __future__ import annotations

import pytest
import torch

from tests.model.conftest import LLAMA3_ROPE
from tokenmill.loaders import load_model


def _logits_both(path, hf_model, num_tokens: int = 24, dtype: str = "auto"):
    loaded = load_model(path, dtype=dtype)
    ids = torch.randint(0, hf_model.config.vocab_size, (num_tokens,),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
        got = loaded.model.compute_logits(loaded.model(ids, torch.arange(num_tokens)))
    return loaded, got, expected


@pytest.mark.parametrize(("arch", "overrides", "num_tokens"), [
    ("llama", {}, 24),
    ("mistral", {}, 24),
    ("qwen2", {}, 24),
    ("qwen3", {"head_dim": 32}, 24),  # head_dim != hidden / heads
    ("llama", {"rope_scaling": LLAMA3_ROPE}, 100),  # positions past the original 32
    ("llama", {"tie_word_embeddings": True}, 24),
], ids=["llama", "mistral", "qwen2-bias", "qwen3-qknorm", "llama3-rope", "tied"])
def test_logits_match_transformers(hf_checkpoint, arch, overrides, num_tokens):
    path, hf_model = hf_checkpoint(arch, **overrides)
    loaded, got, expected = _logits_both(path, hf_model, num_tokens)
    assert loaded.dtype == torch.float32
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    if overrides.get("tie_word_embeddings"):
        model = loaded.model
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_sharded_checkpoint_matches_transformers(hf_checkpoint):
    path, hf_model = hf_checkpoint("llama", save_kwargs={"max_shard_size": "60KB"})
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    _, got, expected = _logits_both(path, hf_model)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_bfloat16_load_is_close_to_float32(hf_checkpoint):
    path, hf_model = hf_checkpoint("llama")
    loaded, got, expected = _logits_both(path, hf_model, dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert got.dtype == torch.float32
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()


def test_loaded_model_is_inference_only(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    model = load_model(path).model
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert len(model.attention_layers()) == 2
