"""The model's tokenizer, as a transformers tokenizer (cached per file).

Building a tokenizer from a GGUF's metadata takes seconds, so the result is
also saved once under tokenmill's cache directory (tokenmill/cache.py) and
loaded from there on later starts.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from tokenmill.cache import cache_dir
from tokenmill.loaders.errors import ModelLoadError
from tokenmill.loaders.model_source import ModelSource

logger = logging.getLogger(__name__)


def load_tokenizer(source: ModelSource) -> Any:
    """A transformers PreTrainedTokenizerFast, cached in-process per path."""
    return _load_tokenizer(source.kind, str(source.path))


def _gguf_cache_path(path: Path) -> Path:
    import transformers

    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return cache_dir() / "tokenizers" / hashlib.sha1(key.encode()).hexdigest()[:16]


def _load_gguf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    cached = _gguf_cache_path(path)
    if (cached / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError, KeyError, TypeError):
            logger.warning("ignoring an unreadable tokenizer cache at %s", cached)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, cached)  # atomic: a concurrent reader never sees half a cache
    except OSError as e:  # a read-only home is fine: just slower next time
        logger.info("could not cache the tokenizer at %s: %s", cached, e)
    return tokenizer


def _default_template(tokenizer: Any, path: Path) -> None:
    """A file without a chat template gets its architecture's (loaders/chat_templates.py)."""
    from tokenmill.loaders.chat_templates import fill_missing_chat_template
    from tokenmill.loaders.gguf import gguf_config_dict

    fill_missing_chat_template(tokenizer, gguf_config_dict(path).get("model_type"))


@functools.lru_cache(maxsize=8)
def _load_tokenizer(kind: str, path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        if kind == "gguf":
            tokenizer = _load_gguf_tokenizer(Path(path))
            _default_template(tokenizer, Path(path))
            return tokenizer
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot load the tokenizer of {path}: {e}") from None
