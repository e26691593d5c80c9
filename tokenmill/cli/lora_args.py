"""vLLM's LoRA flags: --enable-lora, --lora-modules (name=path or its JSON form),
--max-loras, --max-lora-rank, --max-cpu-loras."""

from __future__ import annotations

import argparse
import json
from typing import Any


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: invalid JSON ({e})") from None
        if not isinstance(spec, dict) or not spec.get("name") or not spec.get("path"):
            raise argparse.ArgumentTypeError('--lora-modules JSON needs "name" and "path"')
        return str(spec["name"]), str(spec["path"])
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules: {text!r} is not name=path "
                                         "or a JSON object")
    return name, path


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters (a request's model names one)")
    g.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=[],
                   metavar="NAME=PATH",
                   help="adapters to serve: name=path or "
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
    g.add_argument("--max-loras", type=int, default=1,
                   help="most distinct adapters among the running requests (one batch)")
    g.add_argument("--max-lora-rank", type=int, default=16,
                   help="largest adapter rank accepted")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded; past it the least recently used idle one "
                        "is evicted (default: --max-loras)")


def lora_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"enable_lora": args.enable_lora, "lora_modules": list(args.lora_modules),
            "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank,
            "max_cpu_loras": args.max_cpu_loras}
