"""tokenmill: an LLM inference engine with the measurement loop built in."""

from tokenmill.lora_request import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.version import __version__

__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str):  # lazy: `import tokenmill` must not import torch
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    raise AttributeError(name)
