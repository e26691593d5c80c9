"""Hugging Face safetensors checkpoints (single file or sharded), memory-mapped.

Tensors come out unread (`SafetensorsTensor`): the loader narrows one to the
slice a tensor-parallel rank holds, and only that slice is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass
class SafetensorsTensor:
    """One checkpoint tensor, or a slice of it along one dim, not read yet. Valid while
    its file is open (the iterator below hands them out one at a time)."""

    handle: Any  # safe_open's slice object
    shape: tuple[int, ...]
    dim: int = 0
    start: int = 0

    def narrow(self, dim: int, start: int, length: int) -> SafetensorsTensor:
        if self.shape != tuple(self.handle.get_shape()):
            raise ValueError("a SafetensorsTensor is narrowed once")
        shape = list(self.shape)
        shape[dim] = length
        return SafetensorsTensor(self.handle, tuple(shape), dim, start)

    def load(self) -> torch.Tensor:
        stop = self.start + self.shape[self.dim] if self.shape else None
        index = (slice(None),) * self.dim + (slice(self.start, stop),)
        try:
            return self.handle[index] if self.shape else self.handle[:]
        except SafetensorError as e:
            raise ModelLoadError(f"cannot read a checkpoint tensor: {e}") from None


def iter_safetensors(checkpoint_dir: Path) -> Iterator[tuple[str, SafetensorsTensor]]:
    """(name, unread tensor) for every tensor of the checkpoint, from memory maps."""
    for path in safetensors_files(checkpoint_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    handle = f.get_slice(name)
                    yield name, SafetensorsTensor(handle, tuple(handle.get_shape()))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from None
