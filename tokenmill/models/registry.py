"""Hugging Face architecture name -> model class."""

from __future__ import annotations

from torch import nn

from tokenmill.models.gemma3 import Gemma3ForCausalLM
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.moe import MoeForCausalLM
from tokenmill.models.phi3 import Phi3ForCausalLM

_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return list(_MODEL_CLASSES)


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; tokenmill runs "
                         f"{', '.join(_MODEL_CLASSES)}") from None
