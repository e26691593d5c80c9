"""The model's tokenizer, as a transformers tokenizer (cached per file).

Building a tokenizer from a GGUF's metadata takes seconds (Gemma 3's 262k-token
vocabulary: ~26 s), so the result is saved once under tokenmill's cache directory
(tokenmill/cache.py), keyed by a hash of the file's tokenizer metadata (the bytes of
its `tokenizer.*` keys and its architecture) and the transformers version: a copy of
the file elsewhere, or a re-assembled one, hits the same entry. A hit loads
`tokenizer.json` straight into the Rust `tokenizers` library through
PreTrainedTokenizerFast, without AutoTokenizer (whose import alone costs ~1.5 s of
CPU) and without from_pretrained's Python parse of the JSON. Every cached file is
checked against the SHA-256 recorded beside it when it was written: a corrupted or
half-written entry is rebuilt, never trusted.

The server's front end reads a cache hit with `load_front_end_tokenizer`: the same
entry through the `tokenizers` library alone (loaders/fast_tokenizer.py), so that it
never imports transformers (nor torch) on its way to the first /health 200.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import mmap
import os
import shutil
from pathlib import Path
from typing import Any

from tokenmill.cache import cache_dir
from tokenmill.loaders.errors import ModelLoadError
from tokenmill.loaders.model_source import ModelSource

logger = logging.getLogger(__name__)
_FORMAT = 2  # of a cache entry; a change makes new keys (old entries are left unused)
_MANIFEST = "tokenmill-manifest.json"  # {"files": {name: sha256}}, written last
_CHAT_TEMPLATE = "chat_template.jinja"
# tokenizer_config.json keys that describe the save, not the tokenizer
_NOT_KWARGS = {"backend", "is_local", "local_files_only", "tokenizer_class", "auto_map",
               "name_or_path"}


def load_tokenizer(source: ModelSource) -> Any:
    """A transformers PreTrainedTokenizerFast, cached in-process per path."""
    return _load_tokenizer(source.kind, str(source.path))


def load_front_end_tokenizer(source: ModelSource) -> Any:
    """The server front end's tokenizer: a GGUF's cached tokenizer read without
    transformers (a FastTokenizer); transformers' own where the entry is missing or
    asks for more than the FastTokenizer does, and for a Hugging Face directory."""
    return _load_front_end_tokenizer(source.kind, str(source.path))


@functools.lru_cache(maxsize=8)
def _load_front_end_tokenizer(kind: str, path: str) -> Any:
    if kind == "gguf":
        try:
            tokenizer = _read_cached_fast(_gguf_cache_path(Path(path)))
        except Exception as e:  # noqa: BLE001 - damaged: the full loader rebuilds it
            logger.info("tokenizer cache entry unreadable (%s); loading it with transformers", e)
            tokenizer = None
        if tokenizer is not None:
            _default_template(tokenizer, Path(path))
            return tokenizer
    return _load_tokenizer(kind, path)


def gguf_tokenizer_key(path: Path) -> str:
    """Hash of what the tokenizer is built from: the file's tokenizer metadata bytes,
    the transformers version that converts them, and the cache format."""
    from tokenmill.loaders.gguf_checks import gguf_layout

    layout = gguf_layout(path)
    # the installed version, read without importing transformers (the front end's path)
    version = importlib.metadata.version("transformers")
    digest = hashlib.sha256(f"{_FORMAT}|{version}|".encode())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for start, end in layout.tokenizer_spans:
            digest.update(buf[start:end])
    return digest.hexdigest()[:32]


def _gguf_cache_path(path: Path) -> Path:
    return cache_dir() / "tokenizers" / gguf_tokenizer_key(path)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _checked_files(cached: Path) -> dict[str, str] | None:
    """The entry's files (name -> SHA-256), each checked; None where the entry is
    missing; a ValueError where a file is damaged (its hash is not the one recorded)."""
    try:
        manifest = json.loads((cached / _MANIFEST).read_text())
    except FileNotFoundError:
        return None
    files = manifest["files"]
    for name, digest in files.items():
        if _sha256(cached / name) != digest:
            raise ValueError(f"{name} does not match its recorded hash")
    return files


def _read_cached_fast(cached: Path) -> Any | None:
    """The entry as a FastTokenizer; None where it is missing or needs transformers."""
    from tokenmill.loaders.fast_tokenizer import FastTokenizer

    files = _checked_files(cached)
    if files is None:
        return None
    template = (cached / _CHAT_TEMPLATE).read_text() if _CHAT_TEMPLATE in files else None
    return FastTokenizer.from_saved(cached, template)


def _read_cached(cached: Path) -> Any | None:
    """The tokenizer saved at `cached`, or None where the entry is missing; a ValueError
    where a file is damaged (its hash is not the one recorded)."""
    from transformers import PreTrainedTokenizerFast

    files = _checked_files(cached)
    if files is None:
        return None
    kwargs = {k: v for k, v in json.loads((cached / "tokenizer_config.json").read_text()
                                          ).items() if k not in _NOT_KWARGS}
    if _CHAT_TEMPLATE in files:
        kwargs["chat_template"] = (cached / _CHAT_TEMPLATE).read_text()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(cached / "tokenizer.json"),
                                        **kwargs)
    tokenizer.name_or_path = str(cached)  # what from_pretrained sets: tools read it
    return tokenizer


def _write_cache(tokenizer: Any, cached: Path) -> None:
    """Save, record every file's hash last, and move into place atomically."""
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save_pretrained(str(tmp))
    files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
    if "tokenizer.json" not in files or "tokenizer_config.json" not in files:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError("save_pretrained wrote no tokenizer.json / tokenizer_config.json")
    (tmp / _MANIFEST).write_text(json.dumps({"files": files}))
    if cached.exists():  # a damaged entry: out of the way first (replace needs it gone)
        old = cached.with_name(cached.name + f".old{os.getpid()}")
        os.replace(cached, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, cached)  # a concurrent reader never sees half an entry


def _load_gguf_tokenizer(path: Path) -> Any:
    cached = _gguf_cache_path(path)
    try:
        tokenizer = _read_cached(cached)
        if tokenizer is not None:
            return tokenizer
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exception
        logger.warning("rebuilding the damaged tokenizer cache at %s (%s)", cached, e)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        _write_cache(tokenizer, cached)
    except OSError as e:  # a read-only home is fine: just slower next time
        logger.info("could not cache the tokenizer at %s: %s", cached, e)
    return tokenizer


def _default_template(tokenizer: Any, path: Path) -> None:
    """A file without a chat template gets its architecture's (loaders/chat_templates.py)."""
    from tokenmill.loaders.chat_templates import fill_missing_chat_template
    from tokenmill.loaders.gguf_checks import gguf_layout

    # the config's model_type is the file's general.architecture
    fill_missing_chat_template(tokenizer, gguf_layout(path).metadata.get("general.architecture"))


@functools.lru_cache(maxsize=8)
def _load_tokenizer(kind: str, path: str) -> Any:
    try:
        if kind == "gguf":
            tokenizer = _load_gguf_tokenizer(Path(path))
            _default_template(tokenizer, Path(path))
            return tokenizer
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot load the tokenizer of {path}: {e}") from None
