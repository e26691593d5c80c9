"""Hostile safetensors files: tokenmill reads them only through the safetensors
library's safe_open, whose header checks (length, JSON, offsets inside the
file and contiguous, dtype x shape = byte length) must reach the user as a
ModelLoadError naming the file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tokenmill.loaders import ModelLoadError
from tokenmill.loaders.safetensors import iter_safetensors


def _write(folder: Path, header: dict | bytes, data: bytes, length: int | None = None) -> Path:
    folder.mkdir()
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", n) + raw + data)
    return folder


def _read_all(folder: Path) -> None:
    for _, tensor in iter_safetensors(folder):
        tensor.load()


def test_a_valid_file_reads(tmp_path):
    save_file({"w": torch.ones(4, 4)}, str(tmp_path / "model.safetensors"))
    _read_all(tmp_path)


@pytest.mark.parametrize(("header", "data", "length"), [
    (b"{}", b"", 1 << 62),  # header length past the file
    (b"{not json", b"", None),
    ({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}, b"\0" * 16, None),
    ({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}}, b"\0" * 64, None),
    ({"w": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 64]}},
     b"\0" * 64, None),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, b"\0" * 24, None),
    ({"w": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16, None),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}, b"\0" * 16, None),
])
def test_corrupt_headers_are_load_errors(tmp_path, header, data, length):
    folder = _write(tmp_path / "ckpt", header, data, length)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        _read_all(folder)

