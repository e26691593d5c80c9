"""A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors)
read and checked against the base model: every problem names the adapter and the
key, tensor or module at fault (LoRAAdapterError, a ValueError)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.config import ModelConfig
from tokenmill.loaders.errors import LoRAAdapterError
from tokenmill.models.lora import TARGET_MODULES

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?"
                  r"\.weight$")


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    scaling: float
    target_modules: list[str]
    # (layer, PEFT module name) -> (A (r, in) fp32, B (out, r) fp32 times scaling)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    h, d = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * d, config.num_key_value_heads * d, \
        config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def load_peft_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int
                      ) -> LoRAAdapter:
    from safetensors.torch import load_file

    root = Path(path)
    cfg_path = root / "adapter_config.json"
    if not cfg_path.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no adapter_config.json in {str(root)!r}")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} "
                               "is not LORA")
    rank = int(cfg.get("r", 8))
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r} has rank {rank}, more than "
                               f"--max-lora-rank {max_rank}")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    unknown = [t for t in targets if t not in TARGET_MODULES]
    if unknown:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: target_modules {unknown} are not "
                               f"supported (use {', '.join(TARGET_MODULES)})")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key} is not supported")
    if cfg.get("use_dora"):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: use_dora is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: bias={cfg.get('bias')!r} is not "
                               "supported (only 'none')")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    files = [root / "adapter_model.safetensors"]
    if not files[0].is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no adapter_model.safetensors in "
                               f"{str(root)!r}")
    tensors = load_file(str(files[0]))
    shapes = _module_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA "
                                   "A/B weight of a supported module")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGET_MODULES:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} targets "
                                   f"module {module!r}, which is not supported")
        if layer >= config.num_hidden_layers:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} names layer "
                                   f"{layer}, the base has {config.num_hidden_layers}")
        halves.setdefault((layer, module), {})[half] = t.float()
    weights = {}
    for (layer, module), ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {layer} {module} lacks "
                                   f"lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        out, inp = shapes[module]
        r = a.shape[0]
        if r > max_rank:
            raise LoRAAdapterError(f"LoRA adapter {name!r} has rank {r}, more than "
                                   f"--max-lora-rank {max_rank}")
        if a.shape != (r, inp) or b.shape != (out, r):
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: layer {layer} {module} has lora_A {tuple(a.shape)} "
                f"and lora_B {tuple(b.shape)}; the base model needs ({r}, {inp}) and "
                f"({out}, {r})")
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    if not weights:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no "
                               "LoRA weights")
    return LoRAAdapter(name, rank, scaling, sorted({m for _, m in weights}), weights)
