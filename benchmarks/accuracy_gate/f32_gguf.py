"""FILE-f32.gguf: a GGUF's every tensor dequantized to F32 (gguf's own dequantizers),
its metadata copied (file type set to ALL_F32): llama.cpp's fp32 reference of the
file's own weights, the counterpart of tokenmill's `--dtype float32` on FILE."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from benchmarks.peers.gguf_io import architecture, copy_fields, write_streamed


def f32_path(model: Path, out_dir: Path) -> Path:
    return out_dir / (Path(model).stem + "-f32.gguf")


def write_f32(model: Path, dst: Path) -> Path:
    """Write dst unless it exists (idempotent; written via a .part sibling)."""
    if dst.is_file():
        return dst
    reader = gguf.GGUFReader(str(model))
    v = gguf.GGUFValueType
    fields = [f for f in copy_fields(reader, skip=("general.file_type",))]
    fields.append(("general.file_type", int(gguf.LlamaFileType.ALL_F32), v.UINT32, None))
    tensors = reader.tensors

    def shape(t) -> tuple[int, ...]:
        return tuple(int(x) for x in reversed(t.shape.tolist()))  # ggml ne -> numpy

    infos = [(t.name, shape(t), np.float32) for t in tensors]

    def make(i: int) -> np.ndarray:
        t = tensors[i]
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(data, dtype=np.float32).reshape(infos[i][1])

    write_streamed(dst, architecture(reader), fields, infos, make)
    return dst
