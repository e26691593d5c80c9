"""Every GGUF weight type docs/models.md names, loaded whole: a tiny Llama (hidden 256, so a
K-quant super-block of 256 fits every row) written in one type, its logits compared with
transformers' GGUF loader on the same file.

gguf-py quantizes F16, BF16, Q4_0 and Q8_0 but not the K-quants (its `quantize` raises
NotImplementedError for Q4_K / Q5_K / Q6_K), so those files are written as random blocks
with sane scales: any bit pattern is a valid block, and both loaders must dequantize the
same bytes to the same weights (and undo llama.cpp's q/k row permutation on them)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

HIDDEN, MLP, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 256
Q = gguf.GGMLQuantizationType
# K-quant blocks of 256 weights: bytes per block, and where the fp16 scales sit
K_QUANTS = {
    # type: (block bytes, {byte offset of an fp16 scale: its value})
    "Q4_K": (144, {0: 0.15 / (63 * 15), 2: 0.15 / (63 * 15)}),  # d, dmin first
    "Q5_K": (176, {0: 0.15 / (63 * 31), 2: 0.15 / (63 * 31)}),
    "Q6_K": (210, {208: 0.15 / (128 * 32)}),  # ql, qh, scales, then d
}
TYPES = ["F16", "BF16", "Q4_0", "Q4_K", "Q5_K", "Q6_K"]


def _random_k_blocks(rows: int, cols: int, qtype: str, rng) -> np.ndarray:
    block_bytes, scales = K_QUANTS[qtype]
    blocks = rng.integers(0, 256, (rows * cols // 256, block_bytes), dtype=np.uint8)
    for offset, value in scales.items():
        blocks[:, offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return blocks.reshape(rows, cols // 256 * block_bytes)


def _tensor(shape: tuple[int, int], qtype: str, rng) -> np.ndarray:
    if qtype in K_QUANTS:
        return _random_k_blocks(*shape, qtype, rng)
    w = rng.normal(0.0, 0.1, shape).astype(np.float32)
    if qtype == "F16":
        return w.astype(np.float16)
    return gguf.quants.quantize(w, Q[qtype])


def write_gguf(path, qtype: str) -> None:
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"tiny {qtype}")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(MLP)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
                       f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
                       f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
                       f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
                       f"blk.{i}.ffn_gate.weight": (MLP, HIDDEN),
                       f"blk.{i}.ffn_up.weight": (MLP, HIDDEN),
                       f"blk.{i}.ffn_down.weight": (HIDDEN, MLP)})
    for name, shape in shapes.items():
        w.add_tensor(name, _tensor(shape, qtype, rng), raw_dtype=Q[qtype])
    norms = [f"blk.{i}.{n}.weight" for i in range(LAYERS) for n in ("attn_norm", "ffn_norm")]
    for name in [*norms, "output_norm.weight"]:
        w.add_tensor(name, (1.0 + rng.normal(0.0, 0.1, HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", TYPES)
def test_gguf_roundtrip(qtype, tmp_path):
    import transformers

    from tokenmill.loaders import load_model

    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(path, qtype)
    try:
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    except (ValueError, NotImplementedError, KeyError) as e:  # not a type it can load
        pytest.skip(f"transformers' GGUF loader cannot load {qtype}: {e}")
    loaded = load_model(path, dtype="float32")
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors
             if len(t.shape) == 2}
    assert types == {qtype}
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        got = loaded.model.compute_logits(loaded.model(ids, torch.arange(20)))
    assert expected.abs().max() > 0.1  # the model computes something
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
