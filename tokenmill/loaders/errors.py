"""The ways loading a model (or an adapter) fails, below every loader: model_source.py
resolves names and reads configs, gguf.py and safetensors.py read weights, and
each raises these without importing the others."""

from __future__ import annotations


class ModelSourceError(ValueError):
    """The name or path does not lead to a model tokenmill can load."""


class ModelLoadError(ValueError):
    """The model files exist but cannot be read (corrupt, truncated, unsupported)."""


class LoRAAdapterError(ValueError):
    """A bad adapter: `param` names what is wrong (for a 400 body). Here, beside the
    other load errors and away from the adapter loader's torch, so that the server's
    front end can raise and catch it without importing torch."""

    def __init__(self, message: str, param: str = "lora_path") -> None:
        super().__init__(message)
        self.param = param
