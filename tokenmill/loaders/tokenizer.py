"""The model's tokenizer, as a transformers tokenizer (cached per file)."""

from __future__ import annotations

import functools
from typing import Any

from tokenmill.loaders.model_source import ModelLoadError, ModelSource


def load_tokenizer(source: ModelSource) -> Any:
    """A transformers PreTrainedTokenizerFast. For a GGUF it is built from the file's
    metadata (a few seconds), so it is cached in-process per path."""
    return _load_tokenizer(source.kind, str(source.path))


@functools.lru_cache(maxsize=8)
def _load_tokenizer(kind: str, path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        if kind == "gguf":
            from pathlib import Path

            p = Path(path)
            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot load the tokenizer of {path}: {e}") from None
