"""Small valid GGUF files written with the gguf package's own writer, and the
byte offsets of their fields, so a test (or the fuzzer's seed corpus) can patch
exactly one field of a file that is otherwise a real, loadable model."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, LAYERS = 64, 128, 4, 2, 256, 1


def write_model_gguf(path: Path, *, heads: int = HEADS, kv_heads: int = KV_HEADS,
                     vocab: int = VOCAB, key_length: bool = True,
                     skip_keys: tuple[str, ...] = (), alignment: int | None = None,
                     seed: int = 0) -> Path:
    """A one-layer llama: embeddings and v/down Q8_0, the other linears Q4_1, norms F32."""
    import gguf

    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), "llama")
    keys = {
        "block_count": lambda: w.add_block_count(LAYERS),
        "context_length": lambda: w.add_context_length(128),
        "embedding_length": lambda: w.add_embedding_length(HIDDEN),
        "feed_forward_length": lambda: w.add_feed_forward_length(FFN),
        "head_count": lambda: w.add_head_count(heads),
        "head_count_kv": lambda: w.add_head_count_kv(kv_heads),
        "rms_eps": lambda: w.add_layer_norm_rms_eps(1e-5),
        "vocab_size": lambda: w.add_vocab_size(vocab),
    }
    w.add_name("hostile-file test model")
    for name, add in keys.items():
        if name not in skip_keys:
            add()
    if key_length:
        w.add_key_length(head_dim)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    shapes = {  # Hugging Face (out, in)
        "token_embd.weight": ((VOCAB, HIDDEN), Q.Q8_0),
        "blk.0.attn_norm.weight": ((HIDDEN,), Q.F32),
        "blk.0.attn_q.weight": ((HEADS * head_dim, HIDDEN), Q.Q4_1),
        "blk.0.attn_k.weight": ((KV_HEADS * head_dim, HIDDEN), Q.Q4_1),
        "blk.0.attn_v.weight": ((KV_HEADS * head_dim, HIDDEN), Q.Q8_0),
        "blk.0.attn_output.weight": ((HIDDEN, HEADS * head_dim), Q.Q4_1),
        "blk.0.ffn_norm.weight": ((HIDDEN,), Q.F32),
        "blk.0.ffn_gate.weight": ((FFN, HIDDEN), Q.Q4_1),
        "blk.0.ffn_up.weight": ((FFN, HIDDEN), Q.Q4_1),
        "blk.0.ffn_down.weight": ((HIDDEN, FFN), Q.Q8_0),
        "output_norm.weight": ((HIDDEN,), Q.F32),
    }
    for name, (shape, qtype) in shapes.items():
        data = rng.normal(0, 0.1, shape).astype(np.float32)
        if len(shape) == 1:
            data += 1.0
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def key_value_offset(data: bytes, key: str) -> int:
    """Byte offset of metadata `key`'s type field (its value follows 4 bytes later)."""
    encoded = struct.pack("<Q", len(key)) + key.encode()
    at = data.index(encoded)
    return at + len(encoded)


def tensor_info_offset(data: bytes, name: str) -> int:
    """Byte offset of tensor `name`'s dimension count (then dims, type, offset)."""
    encoded = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(encoded)
    return at + len(encoded)


def tensor_fields(data: bytes, name: str) -> dict[str, int]:
    """Offsets of n_dims, dim0.., type and offset of tensor `name`."""
    at = tensor_info_offset(data, name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    fields = {"n_dims": at}
    for d in range(n_dims):
        fields[f"dim{d}"] = at + 4 + 8 * d
    fields["type"] = at + 4 + 8 * n_dims
    fields["offset"] = fields["type"] + 4
    return fields
