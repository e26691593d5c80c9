"""The two ways loading a model fails, below every loader: model_source.py
resolves names and reads configs, gguf.py and safetensors.py read weights, and
each raises these without importing the others."""

from __future__ import annotations


class ModelSourceError(ValueError):
    """The name or path does not lead to a model tokenmill can load."""


class ModelLoadError(ValueError):
    """The model files exist but cannot be read (corrupt, truncated, unsupported)."""
