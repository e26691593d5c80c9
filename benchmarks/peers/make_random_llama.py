"""A ~1B Llama-architecture GGUF with random weights at real shapes, and its
llama-quantize files, for the memory and bandwidth benchmarks (issue 56 item 3).

    python -m benchmarks.peers.make_random_llama [--types Q4_K_M,Q6_K,Q8_0]

writes into ${TOKENMILL_PEERS_DIR:-~/.cache/tokenmill-peers}/models/:
  llama-1b-random-F16.gguf  hidden 2048, 16 layers, FFN 8192, 32 heads / 8 KV
                            heads, head dim 64, tied embeddings (Llama 3.2 1B's
                            shapes), the embedded SmolLM2 file's tokenizer
                            (49,152 tokens), ~1.07B parameters, ~2.1 GB
  llama-1b-random-{Q4_K_M,Q6_K,Q8_0}.gguf   llama-quantize of it
and prints each path, size and tensor-type counts. Idempotent (existing files
are kept). Weights are normal(0, 0.02) like a real init, norms 1.0, seeded, so
activations stay finite; its outputs are noise, so it is for timing and
memory only, never for accuracy. hidden 2048 is a multiple of 256: K-quants
are really K-quants here (SmolLM2's 576 is not, so llama-quantize falls back).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from benchmarks.peers.gguf_io import copy_fields, write_streamed
from benchmarks.peers.model_files import describe, embedded_gguf, models_dir, quantize

TYPES = ("Q4_K_M", "Q6_K", "Q8_0")
SEED = 56


@dataclass(frozen=True)
class Shape:
    hidden: int = 2048
    layers: int = 16
    ffn: int = 8192
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 49152
    context: int = 8192
    rope_base: float = 500000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def tensor_list(s: Shape) -> list[tuple[str, tuple[int, ...], type]]:
    """(name, numpy shape [out, in], dtype) in llama.cpp's naming; norms F32."""
    kv = s.kv_heads * s.head_dim
    out = [("token_embd.weight", (s.vocab, s.hidden), np.float16)]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (s.hidden,), np.float32),
            (b + "attn_q.weight", (s.hidden, s.hidden), np.float16),
            (b + "attn_k.weight", (kv, s.hidden), np.float16),
            (b + "attn_v.weight", (kv, s.hidden), np.float16),
            (b + "attn_output.weight", (s.hidden, s.hidden), np.float16),
            (b + "ffn_norm.weight", (s.hidden,), np.float32),
            (b + "ffn_gate.weight", (s.ffn, s.hidden), np.float16),
            (b + "ffn_up.weight", (s.ffn, s.hidden), np.float16),
            (b + "ffn_down.weight", (s.hidden, s.ffn), np.float16),
        ]
    out.append(("output_norm.weight", (s.hidden,), np.float32))
    return out


def fields(s: Shape, tokenizer_from: Path) -> list:
    v = gguf.GGUFValueType
    own = [
        ("general.type", "model", v.STRING, None),
        ("general.name", "Llama 1B random weights (tokenmill benchmark)", v.STRING, None),
        ("general.file_type", int(gguf.LlamaFileType.MOSTLY_F16), v.UINT32, None),
        ("llama.vocab_size", s.vocab, v.UINT32, None),
        ("llama.context_length", s.context, v.UINT32, None),
        ("llama.embedding_length", s.hidden, v.UINT32, None),
        ("llama.block_count", s.layers, v.UINT32, None),
        ("llama.feed_forward_length", s.ffn, v.UINT32, None),
        ("llama.rope.dimension_count", s.head_dim, v.UINT32, None),
        ("llama.attention.head_count", s.heads, v.UINT32, None),
        ("llama.attention.head_count_kv", s.kv_heads, v.UINT32, None),
        ("llama.attention.layer_norm_rms_epsilon", s.norm_eps, v.FLOAT32, None),
        ("llama.rope.freq_base", s.rope_base, v.FLOAT32, None),
    ]
    return own + copy_fields(gguf.GGUFReader(str(tokenizer_from)), prefixes=("tokenizer.",))


def write_f16(path: Path, s: Shape = Shape()) -> None:
    tensors = tensor_list(s)
    rng = np.random.default_rng(SEED)

    def make(i: int) -> np.ndarray:
        name, shape, _ = tensors[i]
        if name.endswith("norm.weight"):
            return np.ones(shape, dtype=np.float32)
        w = rng.standard_normal(shape, dtype=np.float32)
        w *= 0.02
        return w.astype(np.float16)

    write_streamed(path, "llama", fields(s, embedded_gguf()), tensors, make)


def make(types: tuple[str, ...] = TYPES) -> list[Path]:
    f16 = models_dir() / "llama-1b-random-F16.gguf"
    if not f16.is_file():
        print(f"writing {f16}", file=sys.stderr, flush=True)
        write_f16(f16)
    paths = [f16]
    for qtype in types:
        dst = models_dir() / f"llama-1b-random-{qtype}.gguf"
        if not dst.is_file():
            quantize(f16, dst, qtype)
        paths.append(dst)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default=",".join(TYPES),
                        help="comma-separated llama-quantize types (default: %(default)s)")
    args = parser.parse_args()
    for path in make(tuple(t for t in args.types.split(",") if t)):
        print(describe(path))


if __name__ == "__main__":
    main()
