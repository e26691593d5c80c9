"""Write a GGUF tensor by tensor with `gguf`'s writer (so a 2 GB file never
sits in memory whole), with metadata copied from another GGUF.

Used by make_random_llama.py (the embedded file's tokenizer on random weights)
and by the accuracy gate's F32 reference (a file's own weights dequantized).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# Written by the writer itself (header counts, architecture) or not metadata.
_WRITER_OWNED = ("GGUF.", "general.architecture")


def copy_fields(reader: gguf.GGUFReader, prefixes: tuple[str, ...] = ("",),
                skip: tuple[str, ...] = ()) -> list[tuple[str, Any, gguf.GGUFValueType,
                                                          gguf.GGUFValueType | None]]:
    """(key, value, type, sub_type) of the reader's fields whose key starts with
    one of `prefixes`, minus those in `skip` and those the writer owns."""
    out = []
    for key, field in reader.fields.items():
        if key.startswith(_WRITER_OWNED) or key in skip or not key.startswith(prefixes):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        out.append((key, value, vtype, sub_type))
    return out


def architecture(reader: gguf.GGUFReader) -> str:
    return reader.fields["general.architecture"].contents()


def write_streamed(path: Path, arch: str,
                   fields: Iterable[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]],
                   tensors: list[tuple[str, tuple[int, ...], np.dtype]],
                   make: Callable[[int], np.ndarray]) -> None:
    """Write `path` (via a `.part` sibling renamed at the end, so a killed run
    leaves no file a later run would reuse): the fields, then the tensors in
    order, tensor i's data made by `make(i)` only when it is written.
    `tensors` holds (name, numpy shape, numpy dtype)."""
    tmp = path.with_name(path.name + ".part")
    writer = gguf.GGUFWriter(tmp, arch)
    for key, value, vtype, sub_type in fields:
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for name, shape, dtype in tensors:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (name, shape, dtype) in enumerate(tensors):
        data = np.ascontiguousarray(make(i), dtype=dtype)
        if data.shape != tuple(shape):
            raise ValueError(f"tensor {name}: made shape {data.shape}, declared {shape}")
        writer.write_tensor_data(data)
    writer.close()
    tmp.replace(path)
