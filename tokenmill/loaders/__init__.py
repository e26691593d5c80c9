"""Load a model: where it comes from (`model_source`, `hub`), its tokenizer
(`tokenizer`), and its weights (`model_loader`: the module built without random
init, then filled).

Naming a source or loading a tokenizer needs no torch; the weight loader's names
are imported on first use, so the server's front end, which starts the engine
core before it loads anything itself, does not pay for torch first.
"""

from __future__ import annotations

from typing import Any

from tokenmill.loaders.errors import ModelLoadError, ModelSourceError
from tokenmill.loaders.model_source import (
    ModelSource,
    hf_config_dict,
    load_model_config,
    resolve_model,
)
from tokenmill.loaders.tokenizer import load_tokenizer

_LOADER = ("LOAD_FORMATS", "LoadedModel", "fill_dummy_weights", "load_model", "load_weights",
           "resolve_dtype")

__all__ = ["LOAD_FORMATS", "LoadedModel", "ModelLoadError", "ModelSource", "ModelSourceError",
           "fill_dummy_weights", "hf_config_dict", "load_model", "load_model_config",
           "load_tokenizer", "load_weights", "resolve_dtype", "resolve_model"]


def __getattr__(name: str) -> Any:
    if name in _LOADER:
        from tokenmill.loaders import model_loader

        return getattr(model_loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
