"""tokenmill: an LLM inference engine with the measurement loop built in."""

from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):  # lazy: `import tokenmill` must not import torch
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    raise AttributeError(name)
