"""vLLM's --generation-config: the checkpoint's generation_config.json supplies
the sampling defaults a request does not set (vLLM's default, `auto`); `vllm`
ignores it; a directory reads that directory's file instead."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenmill.loaders.model_source import ModelSource

logger = logging.getLogger(__name__)

# generation_config.json key -> request field; the keys vLLM reads
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(option: str, source: ModelSource) -> dict[str, Any]:
    if option == "vllm":
        return {}
    if option == "auto":
        if source.kind != "hf":
            return {}  # a GGUF file carries no generation_config.json
        path = source.path / "generation_config.json"
        if not path.is_file():
            return {}
    else:
        path = Path(option).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"--generation-config {option}: no generation_config.json there; "
                             "pass a directory holding one, 'auto' or 'vllm'")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    defaults = {field: config[key] for key, field in _KEYS.items()
                if config.get(key) is not None}
    if defaults:
        logger.info("sampling defaults from %s (a request's own values win): %s",
                    path, defaults)
    return defaults
