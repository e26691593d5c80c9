"""Where tokenmill keeps what it derives once per machine (a GGUF's tokenizer, the
measured CPU roofline): TOKENMILL_CACHE_DIR, else $XDG_CACHE_HOME/tokenmill, else
~/.cache/tokenmill."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenmill")
    return Path(root)
