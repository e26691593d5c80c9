"""GGUF files (llama.cpp) -> Hugging Face style config and weights.

Tensors come out as `GGUFTensor`s: the Hugging Face name, the GGML type, the raw
(still quantized) bytes and the shape; `dequantize()` gives float32 on demand.
llama.cpp's converter permutes the rows of q and k for llama-arch models (its
rotary pairs adjacent dims, Hugging Face's pairs halves); the permutation is
undone here, on the raw rows, so raw blocks and dequantized weights agree with
Hugging Face's layout. Rows can be permuted as raw bytes because quantization
blocks run along the input dimension, within one row.

A tensor-parallel rank reads only its slice (`GGUFTensor.narrow`): rows of the
memory-mapped bytes, or for a row-parallel linear a range of columns cut on
the quantization blocks' boundaries.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, LlamaFileType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quant_shape_to_byte_shape
from numpy.lib.array_utils import byte_bounds

from tokenmill.loaders.errors import ModelLoadError
from tokenmill.loaders.gguf_checks import (  # noqa: F401 - gguf_layout, gguf_errors: here too
    GGUF_ARCHITECTURES,
    GGUFLayout,
    TensorInfo,
    check_gguf,
    gguf_errors,
    gguf_layout,
)
from tokenmill.loaders.gguf_moe import MOE_BLOCK_NAMES, moe_config
from tokenmill.quant.gguf_dequant import dequantize as dequantize_blocks
from tokenmill.quant.gguf_dequant import dequantize_torch

# architectures whose q/k rows llama.cpp's converter permutes
_PERMUTED_QK_ARCHS = {"llama"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    **MOE_BLOCK_NAMES,
}
# Gemma 3 keeps four norms per layer: its ffn_norm is the pre-MLP norm
_ARCH_BLOCK_NAMES = {
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w; transformers (and
# tokenmill's Hugging Face path) hold w, so the loader subtracts the 1 again
_NORM_PLUS_ONE_ARCHS = {"gemma3"}
_UNQUANTIZED = {GGMLQuantizationType.F32, GGMLQuantizationType.F16}
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3 rope scaling, as llama.cpp stores it


def hf_tensor_name(gguf_name: str, arch: str | None = None) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None if unknown."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch or "", {})}
        module = names.get(m.group(2))
        return f"model.layers.{m.group(1)}.{module}.{m.group(3)}" if module else None
    base, _, suffix = gguf_name.rpartition(".")
    module = _GLOBAL_NAMES.get(base)
    return f"{module}.{suffix}" if module and suffix in ("weight", "bias") else None


@dataclass
class GGUFTensor:
    hf_name: str
    qtype: GGMLQuantizationType
    raw: np.ndarray  # uint8 (rows, bytes_per_row) for block types; typed for F32/F16
    shape: tuple[int, ...]  # Hugging Face order, e.g. (out_features, in_features)
    # rows of `raw` in Hugging Face order (q/k of llama-arch files); None: as stored
    row_order: np.ndarray | None = None
    # added to every dequantized value (Gemma's norms: -1, see _NORM_PLUS_ONE_ARCHS)
    value_offset: float = 0.0

    @property
    def is_quantized(self) -> bool:
        return self.qtype not in _UNQUANTIZED

    def _rows(self) -> np.ndarray:
        """The bytes in Hugging Face row order; only these rows are read from the file."""
        raw = self.raw  # (rows, bytes_per_row) as the reader maps it, rows as stored
        if len(self.shape) > 1 and raw.ndim == 1 and self.row_order is None:
            raw = raw.reshape(self.shape[0], -1)
        return raw if self.row_order is None else raw[self.row_order]

    def _copy_rows(self) -> torch.Tensor:
        """`_rows()` copied once, straight into memory torch owns (uint8)."""
        raw = self.raw
        if len(self.shape) > 1 and raw.ndim == 1:
            raw = raw.reshape(self.shape[0], -1)
        raw = raw.view(np.uint8)
        n = raw.shape[0] if self.row_order is None else len(self.row_order)
        out = torch.empty((n, *raw.shape[1:]), dtype=torch.uint8)
        if self.row_order is None:
            np.copyto(out.numpy(), raw)
        else:
            np.take(raw, self.row_order, axis=0, out=out.numpy())
        return out

    def dequantize(self) -> torch.Tensor:
        """float32 tensor of `shape`."""
        fast = dequantize_torch(self._rows(), self.qtype)  # Q4_0 / Q4_1 / Q8_0
        drop_file_pages(self.raw)
        if fast is not None:
            fast = fast.reshape(self.shape)
            return fast + self.value_offset if self.value_offset else fast
        arr = dequantize_blocks(self._rows(), self.qtype).reshape(self.shape)
        drop_file_pages(self.raw)
        if self.value_offset:
            arr = arr + np.float32(self.value_offset)
        return torch.from_numpy(arr) if arr.flags.writeable else torch.tensor(arr)

    load = dequantize  # the loader's name for "this tensor, in float"

    def raw_blocks(self) -> torch.Tensor:
        """The quantized bytes as a uint8 tensor (rows, bytes_per_row), a copy owned by torch;
        ModelLoadError naming the tensor where their size disagrees with shape x type (the
        native kernels trust these sizes)."""
        blocks = self._copy_rows()
        drop_file_pages(self.raw)
        if len(self.shape) < 2:
            return blocks
        block, block_bytes = GGML_QUANT_SIZES[self.qtype]
        rows, cols = int(self.shape[0]), int(np.prod(self.shape[1:], dtype=np.int64))
        if cols % block or blocks.numel() != rows * (cols // block) * block_bytes:
            raise ModelLoadError(
                f"GGUF tensor {self.hf_name}: {blocks.numel()} bytes of {self.qtype.name} "
                f"blocks ({block} weights in {block_bytes} bytes each) cannot hold its shape "
                f"{tuple(self.shape)}")
        return blocks.reshape(rows, -1)

    def narrow(self, dim: int, start: int, length: int) -> GGUFTensor:
        """The slice [start, start + length) along dim 0 (rows) or dim 1 (columns, which
        must fall on the quantization blocks' boundaries), still unread."""
        shape = list(self.shape)
        if dim == 0:
            if self.row_order is not None:
                rows = self.row_order[start:start + length]
                return GGUFTensor(self.hf_name, self.qtype, self.raw, (length, *shape[1:]), rows)
            shape[0] = length
            return GGUFTensor(self.hf_name, self.qtype, self.raw[start:start + length],
                              tuple(shape))
        if len(shape) == 3 and dim == 1:  # stacked experts: these rows of every expert
            shape[1] = length
            return GGUFTensor(self.hf_name, self.qtype, self.raw[:, start:start + length],
                              tuple(shape))
        if dim != len(shape) - 1 or len(shape) not in (2, 3):
            raise ValueError(f"{self.hf_name}: cannot slice dim {dim} of a {len(shape)}-d tensor")
        block, block_bytes = (1, 1) if not self.is_quantized else GGML_QUANT_SIZES[self.qtype]
        if start % block or length % block:
            raise ValueError(f"{self.hf_name}: its {self.qtype.name} blocks hold {block} "
                             f"columns, so columns [{start}, {start + length}) cannot be cut "
                             "from it; choose a tensor-parallel size that splits it on block "
                             "boundaries")
        # a typed array (F32 / F16) is cut in elements, a block type in bytes
        a, b = start // block * block_bytes, (start + length) // block * block_bytes
        raw = self.raw[..., a:b]
        return GGUFTensor(self.hf_name, self.qtype, raw, (*shape[:-1], length), self.row_order)


def drop_file_pages(view: np.ndarray) -> None:
    """Unmap from this process the pages of the file under `view` (a slice of a
    GGUFReader's memory map), once they are copied out: otherwise every page read at
    load stays in the process's RSS until the map closes, a whole second copy of the
    file at the load's peak. The page cache keeps them, so a later read is a minor
    fault. Nothing for an array that is not a view of a memory map."""
    owner = view
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    mapping = owner.base
    if not isinstance(mapping, mmap.mmap) or view.size == 0:
        return
    start = owner.__array_interface__["data"][0]
    lo, hi = byte_bounds(view)
    page = mmap.PAGESIZE
    a = (lo - start) // page * page
    b = min(len(mapping), -(-(hi - start) // page) * page)
    if 0 <= a < b:
        with contextlib.suppress(OSError, ValueError):  # advice only: never fail a load
            mapping.madvise(mmap.MADV_DONTNEED, a, b - a)


class _FastGGUFReader(GGUFReader):
    """GGUFReader reading through a plain ndarray view of its memmap: slicing a
    memmap runs Python-level bookkeeping per slice, and a tokenizer's 100k
    metadata strings make that most of the start-up time (4x faster here)."""

    def _get(self, offset: int, dtype: Any, count: int = 1,
             override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        dt = np.dtype(dtype)
        arr = plain[offset: offset + dt.itemsize * count].view(dt)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


# GGML types gguf's reader maps as typed arrays; every other type as uint8 blocks
_ITEM_TYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


def _map_file(path: Path) -> np.ndarray:
    """The whole file as a read-only uint8 array; unmapped once nothing views it."""
    return np.memmap(path, mode="r").view(np.ndarray)


def _tensor_data(mapped: np.ndarray, layout: GGUFLayout, t: TensorInfo) -> np.ndarray:
    """A tensor's bytes as gguf's reader gives them (ReaderTensor.data): typed and in
    numpy order for float and integer types, uint8 (..., rows, bytes per row) for blocks."""
    qtype = GGMLQuantizationType(t.qtype)
    start = layout.data_start + t.offset
    raw = mapped[start:start + t.n_bytes]
    dims = tuple(reversed(t.dims))
    item = _ITEM_TYPES.get(qtype)
    if item is None:
        return raw.reshape(quant_shape_to_byte_shape(dims, qtype))
    return raw.view(np.dtype(item).newbyteorder(layout.byte_order)).reshape(dims)


@functools.lru_cache(maxsize=4)
def _open_reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    gguf_layout(path)  # checked first (cached per file version)
    return _FastGGUFReader(path)


def release_gguf_readers() -> None:
    """Forget the cached readers, so that their memory maps close once the weights are
    copied out: the tensor pages read at load otherwise stay in the process's RSS (a
    1B model's file, counted again beside its records). Metadata reads reopen the file.
    (The loader's own maps, _map_file's, close with the last tensor viewing them.)"""
    _open_reader.cache_clear()


def open_gguf(path: str | Path) -> GGUFReader:
    """A GGUFReader (cached per file version), or ModelLoadError naming the problem:
    for callers that want gguf's fields; the loader reads `gguf_layout`."""
    path = Path(path)
    with gguf_errors(path, "read"):
        st = os.stat(path)
        return _open_reader(str(path), st.st_mtime_ns, st.st_size)


def _arch(layout: GGUFLayout, path: Path) -> str:
    arch = layout.metadata.get("general.architecture")
    if arch == "phi3":  # attn_qkv / ffn_up hold fused parts; only the HF loader splits them
        raise ModelLoadError(f"GGUF file {path} has architecture 'phi3', which tokenmill "
                             "loads from Hugging Face checkpoints only (Phi3ForCausalLM); "
                             "GGUF phi3 is not supported yet")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF file {path} has architecture {arch!r}, which tokenmill does "
                             f"not support; it loads {', '.join(GGUF_ARCHITECTURES)}")
    return arch


def gguf_config_dict(path: str | Path) -> dict[str, Any]:
    """A Hugging Face style config.json dict built from the file's metadata (no weights read),
    plus `quantization_config` with the GGML types and total weight bytes."""
    path = Path(path)
    layout = gguf_layout(path)
    with gguf_errors(path, "parse the metadata of"):
        return _config_dict(layout, path)


def _config_dict(layout: GGUFLayout, path: Path) -> dict[str, Any]:
    arch = _arch(layout, path)
    meta = layout.metadata

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    tensors = {t.name: t for t in layout.tensors}
    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size")
    if vocab is None:  # the walk gives an array as its length
        vocab = (meta["tokenizer.ggml.tokens"] if "tokenizer.ggml.tokens" in layout.array_types
                 else int(tensors["token_embd.weight"].dims[1]))
    cfg: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", get("expert_feed_forward_length"))),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }
    if arch == "qwen2":
        cfg["attention_bias"] = True
    if arch == "gemma3":
        _gemma3_fields(cfg, get)
    shapes = {t.name: tuple(reversed(t.dims)) for t in layout.tensors}
    cfg.update(moe_config(get, arch, shapes, hidden, cfg["num_hidden_layers"], path))
    scaling_type = get("rope.scaling.type")
    if scaling_type == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": float(get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"GGUF file {path} uses rope scaling {scaling_type!r}, which "
                             "tokenmill does not support")
    if _ROPE_FREQS in tensors:
        info = tensors[_ROPE_FREQS]
        factors = gguf_dequantize(_tensor_data(_map_file(path), layout, info),
                                  GGMLQuantizationType(info.qtype))
        cfg["rope_scaling"] = {"rope_type": "gguf_freq_factors",
                               "freq_factors": [float(x) for x in np.ravel(factors)]}
    file_type = meta.get("general.file_type")
    cfg["quantization_config"] = {
        "quant_method": "gguf",
        "file_type": LlamaFileType(file_type).name if file_type is not None else None,
        "tensor_types": dict(Counter(GGMLQuantizationType(t.qtype).name
                                     for t in layout.tensors)),
        "weight_bytes": int(sum(t.n_bytes for t in layout.tensors)),
    }
    return cfg


def _gemma3_fields(cfg: dict[str, Any], get: Any) -> None:
    """What llama.cpp fixes for gemma3 rather than storing: every 6th layer global, the
    local layers' RoPE base 10k, queries scaled by (hidden / heads) ** -0.5 on the
    62-layer 27B and by head_dim ** -0.5 on the others (llama-model.cpp)."""
    window = get("attention.sliding_window")
    if window is None:
        raise ModelLoadError("gemma3 GGUF file lacks gemma3.attention.sliding_window")
    layers = cfg["num_hidden_layers"]
    cfg.update(
        hidden_act="gelu_pytorch_tanh",
        sliding_window=int(window),
        sliding_window_pattern=6,
        rope_local_base_freq=10_000.0,
        query_pre_attn_scalar=(cfg["hidden_size"] // cfg["num_attention_heads"]
                               if layers == 62 else cfg["head_dim"]),
    )


def _unpermute_index(num_rows: int, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's LlamaModel.permute, as the stored row of each
    Hugging Face row: HF row i is stored row order[i]."""
    half = num_rows // n_head // 2
    stored = np.arange(num_rows).reshape(n_head, half, 2).swapaxes(1, 2).reshape(num_rows)
    return stored


def iter_gguf_tensors(path: str | Path) -> Iterator[GGUFTensor]:
    """Every weight of the file in Hugging Face naming and layout, still quantized."""
    path = Path(path)
    layout = gguf_layout(path)
    cfg = gguf_config_dict(path)
    with gguf_errors(path, "map"):
        mapped = _map_file(path)
    arch = cfg["model_type"]
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    norm_offset = -1.0 if arch in _NORM_PLUS_ONE_ARCHS else 0.0
    for t in layout.tensors:
        if t.name == _ROPE_FREQS:
            continue  # already in the config as rope_scaling
        name = hf_tensor_name(t.name, arch)
        if name is None:
            raise ModelLoadError(f"GGUF file {path}: tensor {t.name!r} has no place in a "
                                 f"{cfg['architectures'][0]}")
        shape = tuple(reversed(t.dims))
        module = name.split(".")[-2]
        order = None
        if arch in _PERMUTED_QK_ARCHS and module in heads:
            order = _unpermute_index(shape[0], heads[module])
        offset = norm_offset if name.endswith("norm.weight") else 0.0
        yield GGUFTensor(name, GGMLQuantizationType(t.qtype), _tensor_data(mapped, layout, t),
                         shape, order, offset)


@dataclass
class QuantizedWeight:
    """The GGUF blocks behind (some rows of) a linear's weight, kept for native kernels."""

    qtype: GGMLQuantizationType
    blocks: torch.Tensor  # uint8 (rows, bytes_per_row), q/k rows already in HF order
    shape: tuple[int, ...]  # dequantized shape of these rows: (rows, in_features)
    row_offset: int  # first row of these rows in the module's (possibly fused) weight
