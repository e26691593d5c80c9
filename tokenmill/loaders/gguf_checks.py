"""A GGUF file is untrusted input: walk its whole header, bounds-checked, before
the gguf package parses it and long before a native kernel sees its bytes.

The gguf package reads in Python/numpy, so a bad file cannot make *it* read
outside the mapping; what it can do is loop for a very long time on a forged
count, allocate without bound, or hand back shapes and offsets that the native
kernels then trust. This walk answers each of those first, with the field's
name: every count is bounded by the bytes that remain, every string and array
by the end of the file, every tensor's dims by GGML's limits, its type by the
known types, its bytes by its shape, its data by the file and by its
neighbours (tensors laid end to end at the file's alignment, as llama.cpp
requires), and the metadata by what makes a model at all (head counts,
widths, vocabulary vs `token_embd`). llama.cpp's gguf.cpp does the same walk.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenmill.loaders.errors import ModelLoadError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ARRAY_DEPTH = 2  # an array of arrays is legal; deeper nesting makes no metadata
_INT64_MAX = (1 << 63) - 1
_DEFAULT_ALIGNMENT = 32
# value type -> (struct code, size); 8 = string, 9 = array
_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
            6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_STRING, _ARRAY = 8, 9
_INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
# GGUF general.architecture -> Hugging Face architecture
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",  # `llama` with expert_count is Mixtral (gguf_moe.py)
}

# smallest encoding of one kv pair (empty key, u8 value) and one tensor info (empty name, 1 dim)
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8


@dataclass
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGML order: dims[0] is the row length
    qtype: int
    offset: int  # relative to the data section
    n_bytes: int = 0


@dataclass
class GGUFLayout:
    """What the walk found: scalar metadata (arrays as their length) and tensor infos."""

    metadata: dict[str, Any] = field(default_factory=dict)
    array_types: dict[str, int] = field(default_factory=dict)  # key -> element type
    tensors: list[TensorInfo] = field(default_factory=list)
    data_start: int = 0
    byte_order: str = "<"  # numpy's: "<" little-endian, ">" a file written big-endian
    # byte ranges of the key-value pairs a tokenizer is built from (tokenizer.*, and
    # general.architecture): what the tokenizer cache is keyed by (tokenizer.py)
    tokenizer_spans: list[tuple[int, int]] = field(default_factory=list)


class _Cursor:
    """Reads little- or big-endian values from a buffer, never past its end."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf, self.path, self.pos, self.order = buf, path, 0, "<"
        self.size = len(buf)

    def fail(self, what: str, problem: str) -> ModelLoadError:
        return ModelLoadError(f"GGUF file {self.path} is corrupt or truncated: {what} {problem} "
                              f"(at byte {self.pos} of {self.size})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(what, f"needs {n} bytes, past the end of the file")

    def scalar(self, code: str, size: int, what: str) -> Any:
        self.need(size, what)
        (value,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar("I", 4, what))

    def u64(self, what: str) -> int:
        return int(self.scalar("Q", 8, what))

    def string(self, what: str, decode: bool = True) -> str | None:
        n = self.u64(f"{what}'s length")
        if n > self.size - self.pos:
            raise self.fail(what, f"claims {n} bytes, more than the {self.size - self.pos} "
                                  "left in the file")
        raw = bytes(self.buf[self.pos:self.pos + n]) if decode else None
        self.pos += n
        if raw is None:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(what, "is not valid UTF-8") from None

    def count(self, what: str, min_item_bytes: int) -> int:
        n = self.u64(what)
        if n * min_item_bytes > self.size - self.pos:
            raise self.fail(what, f"is {n}, more than the rest of the file can hold")
        return n


def _value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> tuple[Any, int | None]:
    """(value, array element type); arrays come back as their length, except short
    integer arrays (per-layer head counts) which come back as a list."""
    if vtype in _SCALARS:
        code, size = _SCALARS[vtype]
        return cur.scalar(code, size, f"metadata {key!r}"), None
    if vtype == _STRING:
        return cur.string(f"metadata {key!r}"), None
    if vtype != _ARRAY:
        raise cur.fail(f"metadata {key!r}", f"has unknown value type {vtype}")
    if depth >= _MAX_ARRAY_DEPTH:
        raise cur.fail(f"metadata {key!r}", "nests arrays too deeply")
    etype = cur.u32(f"metadata {key!r}'s element type")
    if etype in _SCALARS:
        code, size = _SCALARS[etype]
        n = cur.count(f"metadata {key!r}'s element count", size)
        cur.need(n * size, f"metadata {key!r}")
        items: Any = n
        if etype in _INT_TYPES and n <= 1024:
            items = list(struct.unpack_from(f"{cur.order}{n}{code}", cur.buf, cur.pos))
        cur.pos += n * size
        return items, etype
    if etype == _STRING:
        n = cur.count(f"metadata {key!r}'s element count", 8)
        _skip_strings(cur, n, key)
        return n, etype
    if etype == _ARRAY:
        n = cur.count(f"metadata {key!r}'s element count", 4 + 8)
        for _ in range(n):
            _value(cur, _ARRAY, key, depth + 1)
        return n, etype
    raise cur.fail(f"metadata {key!r}", f"is an array of unknown type {etype}")


def _skip_strings(cur: _Cursor, n: int, key: str) -> None:
    """Step over n strings (tokens, merges: only their bounds matter here) in a tight
    loop: a 262k-token vocabulary through `cur.string` took a second at start-up. The
    first one out of bounds is read again by `cur.string`, for its error message."""
    unpack = struct.Struct(cur.order + "Q").unpack_from
    buf, size, pos = cur.buf, cur.size, cur.pos
    for i in range(n):
        if pos + 8 > size:
            break
        end = pos + 8 + unpack(buf, pos)[0]
        if end > size:
            break
        pos = end
    else:
        cur.pos = pos
        return
    cur.pos = pos
    cur.string(f"metadata {key!r}[{i}]", decode=False)  # raises, naming the item
    raise AssertionError("unreachable: the string above is out of bounds")


def _tensor_info(cur: _Cursor, index: int) -> TensorInfo:
    name = cur.string(f"tensor #{index}'s name") or ""
    what = f"tensor {name!r}"
    n_dims = cur.u32(f"{what}'s dimension count")
    if not 1 <= n_dims <= _MAX_DIMS:
        raise cur.fail(what, f"has {n_dims} dimensions; GGML allows 1 to {_MAX_DIMS}")
    dims = tuple(cur.u64(f"{what}'s dimension {d}") for d in range(n_dims))
    qtype = cur.u32(f"{what}'s type")
    offset = cur.u64(f"{what}'s data offset")
    if any(d < 1 for d in dims):
        raise cur.fail(what, f"has an empty dimension {list(dims)}")
    elements = 1
    for d in dims:
        elements *= d
        if elements > _INT64_MAX:
            raise cur.fail(what, f"has {list(dims)} elements, past int64")
    try:
        known = GGMLQuantizationType(qtype) in GGML_QUANT_SIZES
    except ValueError:
        known = False
    if not known:
        raise cur.fail(what, f"has GGML type {qtype}, which no GGUF reader knows")
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if dims[0] % block:
        raise cur.fail(what, f"has rows of {dims[0]} values, not a whole number of "
                             f"{GGMLQuantizationType(qtype).name} blocks of {block}")
    info = TensorInfo(name, dims, qtype, offset, elements // block * block_bytes)
    return info


def walk_gguf(path: Path) -> GGUFLayout:
    """The file's header, fully bounds-checked; ModelLoadError names the first bad field."""
    with open(path, "rb") as f:
        try:
            buf: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            buf = b""
    try:
        return _walk(_Cursor(buf, path))
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()


def _walk(cur: _Cursor) -> GGUFLayout:
    cur.need(4, "the magic")
    if bytes(cur.buf[0:4]) != _MAGIC:
        raise cur.fail("the magic", "is not 'GGUF'; this is not a GGUF file")
    cur.pos = 4
    version = cur.u32("the version")
    if version & 0xFFFF == 0:  # written on a big-endian machine, as the gguf reader guesses
        cur.order, cur.pos = ">", 4
        version = cur.u32("the version")
    if version not in _VERSIONS:
        raise cur.fail("the version", f"is {version}; tokenmill reads GGUF v2 and v3")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.count("the metadata count", _MIN_KV_BYTES)
    if n_tensors * _MIN_TENSOR_INFO_BYTES > cur.size - cur.pos:
        raise cur.fail("the tensor count", f"is {n_tensors}, more than the file can hold")
    layout = GGUFLayout(byte_order=cur.order)
    for i in range(n_kv):
        start = cur.pos
        key = cur.string(f"metadata key #{i}") or ""
        if key in layout.metadata:
            raise cur.fail(f"metadata {key!r}", "appears twice")
        vtype = cur.u32(f"metadata {key!r}'s type")
        layout.metadata[key], etype = _value(cur, vtype, key)
        if etype is not None:
            layout.array_types[key] = etype
        if key.startswith("tokenizer.") or key == "general.architecture":
            layout.tokenizer_spans.append((start, cur.pos))
    names: set[str] = set()
    for i in range(n_tensors):
        info = _tensor_info(cur, i)
        if info.name in names:
            raise cur.fail(f"tensor {info.name!r}", "appears twice")
        names.add(info.name)
        layout.tensors.append(info)
    alignment = layout.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
            or alignment & (alignment - 1)):
        raise cur.fail("metadata 'general.alignment'", f"is {alignment!r}, not a power of two")
    layout.data_start = -(-cur.pos // alignment) * alignment
    _check_data(cur, layout, alignment)
    return layout


def _check_data(cur: _Cursor, layout: GGUFLayout, alignment: int) -> None:
    """Tensors end to end in the order listed, each at the next aligned offset (what
    llama.cpp requires); so a tensor whose type was changed, overlapping or
    out-of-file data all show up as an offset other than the expected one."""
    expected = 0
    for t in layout.tensors:
        what = f"tensor {t.name!r}"
        if t.offset != expected:
            raise ModelLoadError(
                f"GGUF file {cur.path}: {what} starts at data offset {t.offset}, but the "
                f"tensors before it end at {expected}: its data overlaps another tensor's, "
                "leaves a gap, or its type does not match its size")
        end = layout.data_start + t.offset + t.n_bytes
        if end > cur.size:
            raise ModelLoadError(
                f"GGUF file {cur.path} is truncated: {what} ({GGMLQuantizationType(t.qtype).name}"
                f" {list(t.dims)}, {t.n_bytes} bytes) ends at byte {end}, the file has "
                f"{cur.size} bytes")
        expected = -(-(t.offset + t.n_bytes) // alignment) * alignment
    if layout.tensors:
        last = layout.tensors[-1]
        trailing = cur.size - (layout.data_start + last.offset + last.n_bytes)
        if trailing >= alignment:  # the last tensor's type was changed to a smaller one
            raise ModelLoadError(
                f"GGUF file {cur.path}: {trailing} bytes follow the last tensor {last.name!r}; "
                "its type does not match its size, or the file has data appended")


# --- metadata that makes a model -------------------------------------------------------------

_REQUIRED = ("embedding_length", "block_count", "attention.head_count")


def _positive_int(layout: GGUFLayout, path: Path, key: str, required: bool) -> int | None:
    value = layout.metadata.get(key)
    if value is None:
        if required:
            raise ModelLoadError(f"GGUF file {path}: metadata {key!r} is missing")
        return None
    if isinstance(value, list):  # per-layer values: every layer must be positive
        values = value
    elif isinstance(value, bool) or not isinstance(value, int) or key in layout.array_types:
        raise ModelLoadError(f"GGUF file {path}: metadata {key!r} is {value!r}, not an integer")
    else:
        values = [value]
    if not values or any(v <= 0 for v in values):
        raise ModelLoadError(f"GGUF file {path}: metadata {key!r} is {value!r}; it must be "
                             "a positive integer")
    return values[0] if len(set(values)) == 1 else None


def check_model_metadata(layout: GGUFLayout, path: Path) -> None:
    """Head counts, widths and the vocabulary agree with each other and with the tensors."""
    arch = layout.metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelLoadError(f"GGUF file {path}: metadata 'general.architecture' is missing")
    values = {k: _positive_int(layout, path, f"{arch}.{k}", k in _REQUIRED)
              for k in (*_REQUIRED, "attention.head_count_kv", "attention.key_length",
                        "feed_forward_length", "vocab_size", "context_length")}
    width, heads, kv = (values["embedding_length"], values["attention.head_count"],
                        values["attention.head_count_kv"])
    if heads and values["attention.key_length"] is None and width and width % heads:
        raise ModelLoadError(f"GGUF file {path}: {arch}.attention.head_count {heads} does not "
                             f"divide {arch}.embedding_length {width}")
    if heads and kv and heads % kv:
        raise ModelLoadError(f"GGUF file {path}: {arch}.attention.head_count_kv {kv} does not "
                             f"divide {arch}.attention.head_count {heads}")
    tensors = {t.name: t for t in layout.tensors}
    blocks = values["block_count"] or 0
    seen = set()
    for t in layout.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) >= blocks:
            raise ModelLoadError(f"GGUF file {path}: tensor {t.name!r} is past "
                                 f"{arch}.block_count {blocks}")
        if m:
            seen.add(int(m.group(1)))
    if len(seen) != blocks:  # the model is built from block_count before any tensor is read
        missing = next(i for i in range(blocks) if i not in seen)  # blocks may be huge
        raise ModelLoadError(f"GGUF file {path}: {arch}.block_count is {blocks} but no tensor "
                             f"of layer {missing} (blk.{missing}.*) is in the file")
    _check_shapes(layout, path, arch, values)
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"GGUF file {path}: tensor 'token_embd.weight' is missing")
    if len(embd.dims) != 2 or (width and embd.dims[0] != width):
        raise ModelLoadError(f"GGUF file {path}: tensor 'token_embd.weight' has shape "
                             f"{list(embd.dims)}, not [{width}, vocabulary]")
    vocab = values["vocab_size"] or layout.metadata.get("tokenizer.ggml.tokens")
    if isinstance(vocab, int) and vocab != embd.dims[1]:
        raise ModelLoadError(f"GGUF file {path}: tensor 'token_embd.weight' has {embd.dims[1]} "
                             f"rows but the vocabulary has {vocab} tokens")


# GGML order (row length first) of the tensors every llama-style decoder has, from the
# metadata: the model is allocated from the metadata, so a width or head count that
# the tensors do not bear out must fail here, not as a many-GB allocation
_SHAPES = {
    "attn_q": ("width", "q"), "attn_k": ("width", "kv"), "attn_v": ("width", "v"),
    "attn_output": ("q", "width"), "ffn_gate": ("width", "ffn"), "ffn_up": ("width", "ffn"),
    "ffn_down": ("ffn", "width"), "attn_norm": ("width",), "ffn_norm": ("width",),
}


def _check_shapes(layout: GGUFLayout, path: Path, arch: str, values: dict[str, Any]) -> None:
    width, heads, kv = (values["embedding_length"], values["attention.head_count"],
                        values["attention.head_count_kv"] or values["attention.head_count"])
    if not (width and heads and kv):
        return  # per-layer counts: the weight loader's shape checks still apply
    head_dim = values["attention.key_length"] or width // heads
    v_dim = _positive_int(layout, path, f"{arch}.attention.value_length", False) or head_dim
    dims = {"width": width, "q": heads * head_dim, "kv": kv * head_dim, "v": kv * v_dim,
            "ffn": values["feed_forward_length"]}
    for t in layout.tensors:
        m = re.fullmatch(r"blk\.\d+\.(\w+)\.weight", t.name)
        shape = _SHAPES.get(m.group(1)) if m else None
        if m is None and t.name in ("output.weight", "output_norm.weight"):
            shape = ("width", "vocab") if t.name == "output.weight" else ("width",)
        if shape is None:
            continue
        want = [dims.get(d) for d in shape]
        if "vocab" in shape:
            want[1] = t.dims[1]  # checked against the vocabulary with token_embd
        if None not in want and list(t.dims) != want:
            raise ModelLoadError(f"GGUF file {path}: tensor {t.name!r} has shape {list(t.dims)}"
                                 f", but the metadata ({arch}.embedding_length {width}, "
                                 f"head_count {heads}, head_count_kv {kv}, head dim {head_dim}, "
                                 f"feed_forward_length {dims['ffn']}) makes it {want}")
    out = next((t for t in layout.tensors if t.name == "output.weight"), None)
    embd = next((t for t in layout.tensors if t.name == "token_embd.weight"), None)
    if out is not None and embd is not None and out.dims[1] != embd.dims[1]:
        raise ModelLoadError(f"GGUF file {path}: tensor 'output.weight' has {out.dims[1]} rows, "
                             f"'token_embd.weight' {embd.dims[1]}")


def check_gguf(path: Path) -> GGUFLayout:
    """Every structural and model-level check; the one entry point gguf.py calls."""
    layout = walk_gguf(path)
    # an architecture tokenmill does not run is reported as such by gguf.py, not as
    # the keys it lacks
    if layout.metadata.get("general.architecture") in GGUF_ARCHITECTURES:
        check_model_metadata(layout, path)
    return layout


@contextlib.contextmanager
def gguf_errors(path: Path, what: str) -> Iterator[None]:
    """Turn the gguf package's and numpy's errors on a bad file into one ModelLoadError."""
    try:
        yield
    except ModelLoadError:
        raise
    except FileNotFoundError:
        raise ModelLoadError(f"GGUF file {path} does not exist") from None
    except (ValueError, KeyError, IndexError, TypeError, OSError, UnicodeDecodeError,
            OverflowError, MemoryError, NotImplementedError, AttributeError,
            ZeroDivisionError, struct.error) as e:
        raise ModelLoadError(f"cannot {what} GGUF file {path}: the file looks corrupt or "
                             f"truncated ({type(e).__name__}: {e})") from None


@functools.lru_cache(maxsize=8)
def _checked_layout(path: str, mtime_ns: int, size: int) -> GGUFLayout:
    return check_gguf(Path(path))  # untrusted bytes: every size, offset and count


def gguf_layout(path: str | Path) -> GGUFLayout:
    """The file's header, checked (gguf_checks.py) and cached per file version: its
    metadata (arrays as their length) and tensor infos. The loader reads the file
    through this, not through gguf's GGUFReader, whose per-string Python parse of a
    tokenizer's 100k metadata strings took a fifth of a start-up (issue 60)."""
    path = Path(path)
    with gguf_errors(path, "read"):
        st = os.stat(path)
        return _checked_layout(str(path), st.st_mtime_ns, st.st_size)
