"""`tokenmill export-tokenizer MODEL DIR`: the model's tokenizer as files.

A router that tokenizes prompts itself to follow KV events (vllm-router's
`kv_aware` policy reads `VLLM_ROUTER_TOKENIZER`) needs the same tokenizer the
engine uses; a GGUF keeps it inside its metadata, so it is written out here as
`tokenizer.json` + `tokenizer_config.json` (with the chat template).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export-tokenizer", help="write the model's tokenizer.json (for routers)")
    p.add_argument("model", help="smollm2-135m (embedded), a .gguf file or an HF checkpoint dir")
    p.add_argument("out_dir", help="directory to write tokenizer.json and tokenizer_config.json")
    p.set_defaults(func=run)


def export_tokenizer(model: str, out_dir: str | Path) -> Path:
    from tokenmill.loaders.model_source import resolve_model
    from tokenmill.loaders.tokenizer import load_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    load_tokenizer(resolve_model(model)).save_pretrained(str(out))
    return out / "tokenizer.json"


def run(args: argparse.Namespace) -> int:
    path = export_tokenizer(args.model, args.out_dir)
    print(f"wrote {path}")
    return 0
