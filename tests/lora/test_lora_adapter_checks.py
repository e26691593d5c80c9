"""PEFT adapter directories checked against the base model: a bad adapter is refused
with a message naming the adapter and what is wrong (rank, target module, shape)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.model.conftest import make_hf_model, save_hf
from tokenmill.loaders import load_model
from tokenmill.loaders.lora_adapter import LoRAAdapterError, load_peft_adapter

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(base, path, seed: int, r: int = 8, targets=ALL, rslora: bool = False):
    """A peft LoRA with random (non-zero) A and B, saved as PEFT does."""
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, use_rslora=rslora,
                          lora_dropout=0.0)
    model = peft.get_peft_model(base, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base_dir = save_hf(make_hf_model("llama"), root / "base")
    specs = [{"seed": 1}, {"seed": 2, "r": 4, "targets": ["q_proj", "v_proj"]},
             {"seed": 3, "r": 16, "targets": ["gate_proj", "down_proj", "o_proj"], "rslora": True}]
    for i, spec in enumerate(specs):
        write_adapter(make_hf_model("llama"), root / f"a{i}", **spec)
    return root, base_dir


def test_bad_adapters_are_named(setup, tmp_path):
    root, base_dir = setup
    cfg = load_model(base_dir).config
    with pytest.raises(LoRAAdapterError, match="rank 16, more than --max-lora-rank 8"):
        load_peft_adapter("big", root / "a2", cfg, max_rank=8)
    bad = tmp_path / "bad"
    bad.mkdir()
    conf = json.loads((root / "a0" / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**conf, "target_modules": ["fc9"]}))
    with pytest.raises(LoRAAdapterError, match=r"'bad'.*fc9"):
        load_peft_adapter("bad", bad, cfg, max_rank=16)
    from safetensors.torch import load_file, save_file
    t = load_file(str(root / "a0" / "adapter_model.safetensors"))
    key = next(k for k in t if "q_proj.lora_B" in k)
    t[key] = torch.zeros(t[key].shape[0] + 1, t[key].shape[1])
    (bad / "adapter_config.json").write_text(json.dumps(conf))
    save_file(t, str(bad / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="q_proj has lora_A"):
        load_peft_adapter("bad", bad, cfg, max_rank=16)
