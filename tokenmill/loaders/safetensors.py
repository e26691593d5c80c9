"""Hugging Face safetensors checkpoints (single file or sharded), memory-mapped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tokenmill.loaders.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(checkpoint_dir: Path) -> list[Path]:
    """The weight files of a checkpoint: those the shard index names, else every *.safetensors."""
    index = checkpoint_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot read the shard index {index}: {e}") from None
        files = [checkpoint_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{checkpoint_dir} has no *.safetensors files")
    return files


def iter_safetensors(checkpoint_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, read lazily from memory maps."""
    for path in safetensors_files(checkpoint_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from None
