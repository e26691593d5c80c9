"""Every common GGUF type on the quantized-activation kernel (gguf_records.py ->
q4q8_gemv.c): random blocks of each type, the kernel's output against the gguf
package's dequantized weight times the kernel's own quantized activations in float64,
ragged rows, the batched kernel (gemm16) and the AVX2 build; a mixed-type file loaded
whole against transformers' GGUF loader; a type with no kernel named in the log.

Bounds per output, y = sum_k w_k x_k over the dequantized activations x:
- exact forms (Q4_K's own super-blocks, Q5_0, Q5_1, and Q4_0/Q4_1/Q8_0): fp32 scaling
  only, 1e-5 (|x| . |w|);
- Q5_K: the sub-block scale d * sc and min dmin * m rounded to fp16, 2^-11 of each
  term: 1e-3 (|x| . |w|) is loose enough and still catches a misplaced nibble;
- Q6_K's 6-bit form (gguf_records.Q6_SMALL_FORM), records requantized per block of 32:
  each weight moves by at most (max - min) / 126 <= max|w_block| / 63 (plus fp16
  rounding): sum_k |x_k| 1.02 max|w_block(k)| / 63;
- requantized to Q8 (Q6_K by default, IQ4_NL, IQ4_XS): each weight moves by at most half a step of its
  block's fp16 d = max|w| / 127 (plus d's own fp16 rounding), sum_k |x_k| 0.51
  max|w_block(k)| / 127.
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tokenmill.kernels import q4q8_gemv
from tokenmill.quant import gguf_records
from tokenmill.quant.default_arithmetic import default_gguf_arithmetic

pytestmark = pytest.mark.skipif(not q4q8_gemv.available(), reason="q4q8_gemv not built")

# type -> (block weights, block bytes, {offset of an fp16 scale: value}) for random blocks
RANDOM_BLOCKS = {
    Q.Q4_K: (256, 144, {0: 0.15 / (63 * 15), 2: 0.15 / (63 * 15)}),
    Q.Q5_K: (256, 176, {0: 0.15 / (63 * 31), 2: 0.15 / (63 * 31)}),
    Q.Q6_K: (256, 210, {208: 0.15 / (128 * 32)}),
    Q.IQ4_NL: (32, 18, {0: 0.15 / 127}),
    Q.IQ4_XS: (256, 136, {0: 0.15 / (32 * 127)}),
}
EXACT = {Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_K}
FP16_SCALES = {Q.Q5_K}
TYPES = [Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.IQ4_NL, Q.IQ4_XS, Q.Q8_0]
FORMATS = {Q.Q5_0: q4q8_gemv.FORMAT_Q5, Q.Q5_1: q4q8_gemv.FORMAT_Q5,
           Q.Q5_K: q4q8_gemv.FORMAT_Q5, Q.Q6_K: q4q8_gemv.FORMAT_Q8,
           Q.Q4_K: q4q8_gemv.FORMAT_Q4K, Q.Q8_0: q4q8_gemv.FORMAT_Q8,
           Q.IQ4_NL: q4q8_gemv.FORMAT_Q8, Q.IQ4_XS: q4q8_gemv.FORMAT_Q8}
RAGGED_ROWS = [1, 2, 3, 5, 9]


class Shard:  # the loader's QuantizedWeight, as gguf_records reads it
    def __init__(self, qtype, blocks, shape, row_offset=0):
        self.qtype, self.blocks, self.shape, self.row_offset = qtype, blocks, shape, row_offset


def _blocks(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in RANDOM_BLOCKS:
        size, nbytes, scales = RANDOM_BLOCKS[qtype]
        b = rng.integers(0, 256, (n * k // size, nbytes), dtype=np.uint8)
        for offset, value in scales.items():  # sane scales, varied per block
            v = (value * rng.uniform(0.25, 1.0, len(b))).astype(np.float16)
            b[:, offset:offset + 2] = v.view(np.uint8).reshape(-1, 2)
        return b.reshape(n, -1)
    w = rng.normal(0.0, 0.1, (n, k)).astype(np.float32)
    return gguf.quants.quantize(w, qtype)


def _shard(qtype, n, k, seed=0, row_offset=0):
    blocks = _blocks(qtype, n, k, seed)
    w = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(n, k)).double()
    return Shard(qtype, torch.from_numpy(np.ascontiguousarray(blocks)), (n, k), row_offset), w


def _bound(qtypes, w, xd):
    """Per-output bound (see the module docstring), w (N, K) made of row ranges by type."""
    base = 1e-5 * (xd.abs() @ w.abs().T) + 1e-30
    if all(t in EXACT for t in qtypes):
        return base
    if all(t in EXACT | FP16_SCALES for t in qtypes):
        return 1e-3 * (xd.abs() @ w.abs().T) + 1e-30
    half_step = 1.02 / 63 if Q.Q6_K in qtypes and gguf_records.Q6_SMALL_FORM else 0.51 / 127
    step = w.abs().reshape(w.shape[0], -1, 32).amax(-1, keepdim=True) * half_step
    return base + 1e-3 * (xd.abs() @ w.abs().T) * bool(FP16_SCALES & set(qtypes)) + (
        xd.abs() @ step.expand(-1, -1, 32).reshape(w.shape).T)


def _dequantized_input(x, bits):
    q, d, _ = q4q8_gemv.quantize(x, bits)
    m, k = x.shape
    return (q.double().reshape(m, -1, 32) * d.double()[..., None]).reshape(m, k)


def _check(y, x, w, qtypes, bits):
    xd = _dequantized_input(x, bits)
    err = (y.double() - xd @ w.T).abs()
    bound = _bound(qtypes, w, xd)
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"


@pytest.mark.parametrize("bits", q4q8_gemv.BITS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_records_of_each_type_times_activations_match_gguf_dequantization(qtype, bits):
    n, k = 100, 512  # 100 rows: a ragged last group of 16
    shard, w = _shard(qtype, n, k)
    packed, fmt, form = gguf_records.repack_shards([shard])
    assert form == gguf_records.FORMS[qtype] and fmt == FORMATS[qtype]
    _check_records(packed, fmt, n, k, w, qtype, bits)


def _check_records(packed, fmt, n, k, w, qtype, bits):
    assert packed.numel() == -(-n // 16) * (k // 32) * q4q8_gemv.RECORD_BYTES[fmt]
    for rows in RAGGED_ROWS:
        x = (3 * torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))).bfloat16()
        y = q4q8_gemv.linear(x, packed, n, fmt, torch.float32, bits)
        assert y is not None
        _check(y, x, w, [qtype], bits)


@pytest.mark.parametrize("bits", q4q8_gemv.BITS)
def test_q6_k_small_form_records_match_within_their_requantization(bits, monkeypatch):
    """Q6_K's opt-in 6-bit records (FMT_Q6, 28 bytes a block against the 8-bit form's
    34) within their own bound; the default 8-bit form's error is 4x smaller (the
    accuracy gate's reason for it)."""
    monkeypatch.setattr(gguf_records, "Q6_SMALL_FORM", True)
    shard, w = _shard(Q.Q6_K, 100, 512)
    packed, fmt, form = gguf_records.repack_shards([shard])
    assert form == gguf_records.Q6_SMALL_FORM_NAME and fmt == q4q8_gemv.FORMAT_Q6
    _check_records(packed, fmt, 100, 512, w, Q.Q6_K, bits)


def test_q6_k_default_form_is_closer_to_the_file_than_the_small_one(monkeypatch):
    """The 8-bit form's largest weight error is several times below the 6-bit one's
    (kernel output against gguf's dequantization, 16-bit activations so the weights'
    error dominates)."""
    shard, w = _shard(Q.Q6_K, 64, 512)
    x = (3 * torch.randn(4, 512, generator=torch.Generator().manual_seed(1))).bfloat16()
    xd = _dequantized_input(x, 16)
    errs = []
    for small in (False, True):
        monkeypatch.setattr(gguf_records, "Q6_SMALL_FORM", small)
        packed, fmt, _ = gguf_records.repack_shards([shard])
        y = q4q8_gemv.linear(x, packed, 64, fmt, torch.float32, 16)
        errs.append((y.double() - xd @ w.T).abs().mean().item())
    assert errs[0] * 3 < errs[1], errs


def test_records_keep_about_the_file_bytes():
    """<= ~1.1x each type's own bytes (IQ4's and Q6_K's 8-bit records aside: Q6_K 34
    bytes a block of 32 for 26.25, its 6-bit form 28); Q4_K's exactly its own (issue 56:
    4.5 bits a weight where the per-32 records took 5.0)."""
    for qtype, limit in ((Q.Q4_K, 1.0), (Q.Q5_0, 1.10), (Q.Q5_1, 1.0), (Q.Q5_K, 1.10),
                         (Q.Q6_K, 1.30)):
        shard, _ = _shard(qtype, 64, 1024)
        packed, _, _ = gguf_records.repack_shards([shard])
        assert packed.numel() <= limit * shard.blocks.numel()


def _fused(types, rows, k=256):
    shards, ws, row = [], [], 0
    for i, (t, n) in enumerate(zip(types, rows, strict=True)):
        s, w = _shard(t, n, k, seed=i, row_offset=row)
        shards.append(s)
        ws.append(w)
        row += n
    return shards, torch.cat(ws), row


# (types, rows of each part, the format the fused records take)
FUSED = [((Q.Q5_0, Q.Q5_0, Q.Q8_0), (48, 64, 80), q4q8_gemv.FORMAT_MIXED),  # q5 | q8
         ((Q.Q5_0, Q.Q5_1), (48, 40), q4q8_gemv.FORMAT_Q5),  # one form
         ((Q.Q4_K, Q.Q6_K), (48, 64), q4q8_gemv.FORMAT_MIXED),  # gate_up: q4 | q6
         ((Q.Q4_K, Q.Q4_K, Q.Q6_K), (64, 32, 40), q4q8_gemv.FORMAT_MIXED),  # qkv, ragged v
         ((Q.Q6_K, Q.Q4_0, Q.Q8_0, Q.Q4_1), (32, 16, 16, 16), q4q8_gemv.FORMAT_MIXED),
         ((Q.Q4_K, Q.Q6_K), (40, 64), q4q8_gemv.FORMAT_Q8)]  # q4 rows end mid-group


@pytest.mark.parametrize(("types", "rows", "fmt"), FUSED)
def test_fused_shards_of_different_types_keep_each_parts_form(types, rows, fmt):
    """A fused qkv of Q5_0 q/k and a Q8_0 v (llama-quantize's Q4_K_M of SmolLM2) keeps
    5-bit q/k records beside the 8-bit v, Q4_K parts beside Q6_K ones their 4-bit
    records (per-part formats), unless a part's rows end inside a group of 16. Every shard's rows in
    place, per-row and batched kernels alike."""
    shards, w, n = _fused(types, rows)
    packed, got_fmt, _ = gguf_records.repack_shards(shards)
    assert got_fmt == fmt
    if fmt == q4q8_gemv.FORMAT_MIXED:  # each part its own bytes: no part widened
        alone = sum(gguf_records.repack_shards([s])[0].numel() for s in shards)
        assert packed.numel() <= alone + q4q8_gemv.MIXED_HEADER + 16 * 8 * 544
    for m in (3, 29):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
        y = q4q8_gemv.linear(x, packed, n, got_fmt, torch.float32, 16)
        _check(y, x, w, list(types), 16)
        assert torch.equal(q4q8_gemv.gemm16(x, packed, n, got_fmt, torch.float32), y)
    assert q4q8_gemv.linear(x, packed[:-1], n, got_fmt) is None  # a short buffer: refused


def test_batched_kernel_gives_the_per_row_kernels_bits():
    shard, _ = _shard(Q.Q4_K, 80, 512)
    for s in (shard, _shard(Q.Q6_K, 80, 512)[0]):
        packed, fmt, _ = gguf_records.repack_shards([s])
        x = (2 * torch.randn(29, 512, generator=torch.Generator().manual_seed(2))).bfloat16()
        assert torch.equal(q4q8_gemv.gemm16(x, packed, 80, fmt, torch.float32),
                           q4q8_gemv.linear(x, packed, 80, fmt, torch.float32, 16))


def test_the_avx2_build_runs_the_new_types_records():
    """An AVX-512 machine builds and runs the AVX2 variant too (x86-64-v3)."""
    from tests.model.conftest import load_for_march

    lib = load_for_march(q4q8_gemv._lib, "x86-64-v3")
    assert lib.tm_q4q8_isa() == 1
    cases = [([qtype], *_shard(qtype, 100, 256)) for qtype in (Q.Q4_K, Q.Q5_0, Q.Q6_K)]
    shards, w, _ = _fused(*FUSED[2][:2])  # per-part formats: 64 + 32 rows q4, 4 q8
    cases.append((list(FUSED[2][0]), shards, w))
    for types, shard, w in cases:
        packed, fmt, _ = gguf_records.repack_shards(shard if isinstance(shard, list)
                                                    else [shard])
        n = w.shape[0]
        for rows in (1, 3, 5, 29):
            x = (2 * torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
                 ).bfloat16()
            y = torch.empty(rows, n)
            fn = lib.tm_q4q8_gemm16 if rows == 29 else lib.tm_q4q8_linear
            args = (x.data_ptr(), rows, 256, packed.data_ptr(), n, fmt)
            rc = fn(*args, y.data_ptr(), 1, 2) if rows == 29 else fn(*args, 16, y.data_ptr(),
                                                                    1, 1)
            assert rc == 0
            _check(y, x, w, types, 16)


def test_q8_rows_gathered_by_the_kernel_are_the_records_weights():
    """A tied Q8_0 embedding's lookups (record_rows, a decode step's rows) go through
    the kernel's gather, in each build this machine runs: gguf's dequantization of the
    rows asked, exactly, at group edges too; an id out of range is refused."""
    from tests.model.conftest import load_for_march
    from tokenmill.quant import record_rows

    shard, w = _shard(Q.Q8_0, 100, 256)
    packed, fmt, _ = gguf_records.repack_shards([shard])
    assert fmt == q4q8_gemv.FORMAT_Q8
    ids = torch.tensor([0, 15, 16, 99, 57, 57])
    rows = q4q8_gemv.q8_record_rows(packed, 256, ids)
    assert torch.equal(rows.double(), w[ids])
    assert np.array_equal(record_rows.rows_of_records(packed, fmt, 256, ids.numpy()),
                          rows.numpy())
    assert q4q8_gemv.q8_record_rows(packed, 256, torch.tensor([100]), rows=100) is None
    assert q4q8_gemv.q8_record_rows(packed, 256, torch.tensor([-1])) is None
    assert q4q8_gemv.q8_record_rows(packed, 256, torch.tensor([112])) is None  # past the padding
    avx2 = load_for_march(q4q8_gemv._lib, "x86-64-v3")
    out = torch.empty(len(ids), 256)
    assert avx2.tm_q8_record_rows(packed.data_ptr(), 100, 256, ids.data_ptr(), len(ids),
                                  out.data_ptr()) == 0
    assert torch.equal(out, rows)


def test_types_without_records_are_none():
    shard, _ = _shard(Q.Q4_0, 16, 256)
    shard.qtype = Q.IQ2_XXS
    assert gguf_records.repack_shards([shard]) is None


# --- whole files -----------------------------------------------------------------------

def _write_mixed(path, types_by_tensor, tied=False):
    from tests.model import test_gguf_types as t

    rng = np.random.default_rng(0)
    head_dim = t.HIDDEN // t.HEADS
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(t.LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(t.HIDDEN)
    w.add_feed_forward_length(t.MLP)
    w.add_head_count(t.HEADS)
    w.add_head_count_kv(t.KV_HEADS)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(t.VOCAB)
    shapes = {"token_embd.weight": (t.VOCAB, t.HIDDEN)}
    if not tied:  # a tied file has no output.weight: the LM head is the embedding
        shapes["output.weight"] = (t.VOCAB, t.HIDDEN)
    for i in range(t.LAYERS):
        shapes.update({f"blk.{i}.attn_q.weight": (t.HIDDEN, t.HIDDEN),
                       f"blk.{i}.attn_k.weight": (t.KV_HEADS * head_dim, t.HIDDEN),
                       f"blk.{i}.attn_v.weight": (t.KV_HEADS * head_dim, t.HIDDEN),
                       f"blk.{i}.attn_output.weight": (t.HIDDEN, t.HIDDEN),
                       f"blk.{i}.ffn_gate.weight": (t.MLP, t.HIDDEN),
                       f"blk.{i}.ffn_up.weight": (t.MLP, t.HIDDEN),
                       f"blk.{i}.ffn_down.weight": (t.HIDDEN, t.MLP)})
    for j, (name, shape) in enumerate(shapes.items()):
        qtype = types_by_tensor(name, j)
        w.add_tensor(name, _blocks(qtype, *shape, seed=j), raw_dtype=qtype)
    norms = [f"blk.{i}.{n}.weight" for i in range(t.LAYERS) for n in ("attn_norm", "ffn_norm")]
    for name in [*norms, "output_norm.weight"]:
        w.add_tensor(name, (1.0 + rng.normal(0.0, 0.1, t.HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tokenmill_logits(path, ids):
    from tokenmill.engine.runner.weights import load_engine_model
    from tokenmill.loaders import resolve_model

    loaded, method = load_engine_model(resolve_model(str(path)), "auto", None,
                                       torch.device("cpu"))
    with torch.no_grad():
        hidden = loaded.model(ids, torch.arange(len(ids)))
        return loaded.model.compute_logits(hidden).float(), loaded.model, method


MIXED = [Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_K, Q.Q4_1]


def test_a_mixed_type_file_runs_each_tensor_natively_and_matches_transformers(tmp_path,
                                                                            caplog):
    import transformers

    from tests.model import test_gguf_types as t

    path = tmp_path / "mixed.gguf"
    _write_mixed(path, lambda name, j: MIXED[j % len(MIXED)])
    try:
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    except (ValueError, NotImplementedError, KeyError) as e:
        pytest.skip(f"transformers' GGUF loader cannot load this file: {e}")
    ids = torch.randint(0, t.VOCAB, (12,), generator=torch.Generator().manual_seed(3))
    with caplog.at_level(logging.INFO, logger="tokenmill.quant.weight_report"):
        got, model, method = _tokenmill_logits(path, ids)
    default = default_gguf_arithmetic()
    assert method == default.method
    report = model.weight_forms
    assert not report["kept_float"], report["kept_float"]  # every linear on the kernel
    assert report["float_copy_bytes"] == 0 or report["float_copy"].startswith("--batched")
    forms = " ".join(f for v in report["linears"].values() for f in v)
    for name in ("Q5_0", "Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q4_1"):
        assert name in forms
    assert f"weights ({default.reason})" in caplog.text
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    # bf16 activations and the requantized tensors: compare as a user would, the
    # distribution over the next token and the top choices
    assert expected.abs().max() > 0.1
    p, q = expected.log_softmax(-1), got.log_softmax(-1)
    kld = (p.exp() * (p - q)).sum(-1)
    assert kld.max() < 0.02, kld
    assert (expected.argmax(-1) == got.argmax(-1)).float().mean() >= 0.9


def test_a_type_without_a_kernel_is_dequantized_and_named_in_the_log(tmp_path, caplog,
                                                                    monkeypatch):
    """IQ2_XXS blocks are not random-safe to write here; Q2_K stands for a type with no
    record form: its linears stay float and the log names the type and the tensors."""
    path = tmp_path / "q2k.gguf"
    monkeypatch.setitem(RANDOM_BLOCKS, Q.Q2_K, (256, 84, {80: 0.15 / 45, 82: 0.15 / 45}))
    _write_mixed(path, lambda name, j: Q.Q2_K if "ffn_down" in name else Q.Q8_0)
    with caplog.at_level(logging.INFO, logger="tokenmill.quant.weight_report"):
        _, model, _ = _tokenmill_logits(path, torch.arange(4))
    kept = model.weight_forms["kept_float"]
    assert sorted(kept) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert "Q2_K has no native kernel" in caplog.text
    assert "model.layers.0.mlp.down_proj" in caplog.text
    # a file of that type alone: no native path at all, and still named
    _write_mixed(path, lambda name, j: Q.Q2_K)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tokenmill.quant.weight_report"):
        _, model, method = _tokenmill_logits(path, torch.arange(4))
    assert method == "none" and len(model.weight_forms["kept_float"]) == 4 * 2 + 1
    assert "Q2_K has no native kernel" in caplog.text


def test_a_model_past_the_float_copy_limit_keeps_no_float_copy_and_its_embedding_in_blocks(
        tmp_path, monkeypatch):
    """--batched-linears auto resolves to none past FLOAT_COPY_LIMIT_BYTES (here the
    tiny file with the limit lowered): no packed bf16 copy, the embedding in its blocks,
    and the logits those of the model that keeps both in float (Q6_K in its 6-bit form
    for both, as past the limit)."""
    from tests.model import test_gguf_types as t
    from tokenmill.engine.runner.weights import load_engine_model
    from tokenmill.loaders import resolve_model
    from tokenmill.quant import model as quant_model
    from tokenmill.quant.embedding import GGUFEmbedding

    assert quant_model.resolve_batched_linears("auto", "gguf-a16", torch.bfloat16, True,
                                               2 << 30) == "none"
    assert quant_model.resolve_batched_linears("bf16", "gguf-a16", torch.bfloat16, True,
                                               2 << 30) == "bf16"  # the explicit opt-in
    path = tmp_path / "mixed.gguf"
    _write_mixed(path, lambda name, j: Q.Q4_K if name == "token_embd.weight"
                 else MIXED[j % len(MIXED)])
    ids = torch.randint(0, t.VOCAB, (9,), generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(gguf_records, "Q6_SMALL_FORM", True)
    logits = []
    for limit in (1 << 40, 0):
        quant_model.FLOAT_COPY_LIMIT_BYTES, saved = limit, quant_model.FLOAT_COPY_LIMIT_BYTES
        try:
            loaded, _ = load_engine_model(resolve_model(str(path)), "auto", None,
                                          torch.device("cpu"))
        finally:
            quant_model.FLOAT_COPY_LIMIT_BYTES = saved
        with torch.no_grad():
            logits.append(loaded.model.compute_logits(loaded.model(ids, torch.arange(9))))
    report = loaded.model.weight_forms
    assert report["float_copy_bytes"] == 0 and "none kept" in report["float_copy"]
    embed = loaded.model.model.embed_tokens
    assert isinstance(embed, GGUFEmbedding) and report["embedding"].startswith("Q4_K blocks")
    assert report["other_float_bytes"] < 4 * t.HIDDEN * (2 * t.LAYERS + 1)  # norms only
    table = torch.from_numpy(gguf.quants.dequantize(embed.blocks.numpy(), Q.Q4_K)).bfloat16()
    assert torch.equal(embed(ids), table.reshape(t.VOCAB, t.HIDDEN)[ids])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def _load(path, float_copy_limit):
    from tokenmill.engine.runner.weights import load_engine_model
    from tokenmill.loaders import resolve_model
    from tokenmill.quant import model as quant_model

    quant_model.FLOAT_COPY_LIMIT_BYTES, saved = float_copy_limit, \
        quant_model.FLOAT_COPY_LIMIT_BYTES
    try:
        return load_engine_model(resolve_model(str(path)), "auto", None,
                                 torch.device("cpu"))[0].model
    finally:
        quant_model.FLOAT_COPY_LIMIT_BYTES = saved


@pytest.mark.parametrize("embed_type", [Q.Q8_0, Q.Q6_K, Q.Q4_K], ids=lambda t: t.name)
def test_a_tied_embedding_is_kept_once_in_the_lm_heads_records(tmp_path, monkeypatch,
                                                               embed_type):
    """A tied file past the float-copy limit: the embedding's rows come from the LM
    head's records (no second copy in blocks), the resident bytes drop by the blocks'
    size, and the rows are gguf's dequantization (exactly where the records are exact,
    Q8_0 and Q4_K's super-blocks; within the 8-bit records' requantization for Q6_K)."""
    from tests.model import test_gguf_types as t
    from tokenmill.quant import model as quant_model
    from tokenmill.quant.embedding import GGUFEmbedding, RecordsEmbedding

    path = tmp_path / "tied.gguf"
    _write_mixed(path, lambda name, j: embed_type if name == "token_embd.weight"
                 else MIXED[j % len(MIXED)], tied=True)
    ids = torch.randint(0, t.VOCAB, (9,), generator=torch.Generator().manual_seed(5))
    once = _load(path, 0)
    embed = once.model.embed_tokens
    assert isinstance(embed, RecordsEmbedding)
    report = once.weight_forms
    assert report["embedding_bytes"] == 0 and "LM head" in report["embedding"]
    blocks = gguf.GGUFReader(str(path)).get_tensor(0)
    assert blocks.name == "token_embd.weight"
    table = torch.from_numpy(gguf.quants.dequantize(np.asarray(blocks.data), embed_type)
                             ).reshape(t.VOCAB, t.HIDDEN)
    rows = embed(ids).float()
    if embed_type in (Q.Q8_0, Q.Q4_K):
        assert torch.equal(embed(ids), table.bfloat16()[ids])
    else:  # past the float-copy limit Q6_K takes the 6-bit records, requantized per
        # block of 32 (|error| <= (max - min) / 126 <= max|w| / 63, gguf_records), then bf16
        bound = table.reshape(t.VOCAB, -1, 32).abs().amax(-1).repeat_interleave(32, -1) / 63
        assert ((rows - table[ids]).abs() <= 1.02 * bound[ids] + table[ids].abs() / 128).all()
    # the same file kept as before (the embedding in its own blocks beside the head)
    monkeypatch.setattr(quant_model, "embedding_from_head", lambda *a: False)
    twice = _load(path, 0)
    assert isinstance(twice.model.embed_tokens, GGUFEmbedding)
    before = twice.weight_forms
    assert before["resident_bytes"] - report["resident_bytes"] == before["embedding_bytes"] \
        == blocks.n_bytes
    with torch.no_grad():
        a = once.compute_logits(once(ids, torch.arange(9)))
        b = twice.compute_logits(twice(ids, torch.arange(9)))
    if embed_type in (Q.Q8_0, Q.Q4_K):  # the same rows: the same logits
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_q6_k_takes_its_small_form_only_past_the_float_copy_limit(tmp_path):
    """Q6_K's 8-bit records (closer to the file: the accuracy gate) for a model whose
    float copy is small; past FLOAT_COPY_LIMIT_BYTES its 6-bit records, so resident
    weights stay near the file's bytes (issue 56), named in the weight report."""
    path = tmp_path / "q6.gguf"
    _write_mixed(path, lambda name, j: Q.Q8_0 if name == "token_embd.weight" else Q.Q6_K)

    def q6_forms(model):
        return {form for forms in model.weight_forms["linears"].values() for form in forms
                if "Q6_K" in form}

    small, large = _load(path, 1 << 40), _load(path, 0)
    assert q6_forms(small) == {"Q6_K as q8 requantized"}
    assert q6_forms(large) == {f"Q6_K as {gguf_records.Q6_SMALL_FORM_NAME}"}
    assert large.weight_forms["lowbit_bytes"] < 0.9 * small.weight_forms["lowbit_bytes"]
    assert gguf_records.Q6_SMALL_FORM is False  # the choice does not outlive the load


def test_blocks_that_cannot_hold_the_shape_are_a_load_error_naming_the_tensor():
    from tokenmill.loaders.errors import ModelLoadError
    from tokenmill.loaders.gguf import GGUFTensor

    good = _blocks(Q.Q4_K, 4, 512)
    assert GGUFTensor("w.weight", Q.Q4_K, good, (4, 512)).raw_blocks().shape == (4, 288)
    for raw, shape in ((good[:, :200], (4, 512)), (good, (4, 500)), (good, (5, 512))):
        with pytest.raises(ModelLoadError, match="model.layers.3.mlp.down_proj.weight"):
            GGUFTensor("model.layers.3.mlp.down_proj.weight", Q.Q4_K, raw, shape).raw_blocks()
    shard, _ = _shard(Q.Q6_K, 16, 256)
    shard.shape = (16, 512)  # the records' sizes are checked again before any kernel
    with pytest.raises(ValueError, match="Q6_K blocks"):
        gguf_records.repack_shards([shard])


def test_server_info_carries_the_weight_forms():
    import json
    from types import SimpleNamespace

    from tokenmill.config import EngineConfig
    from tokenmill.engine.core.server_info import server_info

    forms = {"method": "gguf-a16", "linears": {"down_proj": {"Q6_K as q8 requantized": 2}},
             "lowbit_bytes": 10, "float_copy_bytes": 0, "float_copy": "none kept",
             "kept_float": {}, "embedding": "float", "embedding_bytes": 0,
             "other_float_bytes": 4}
    llm = SimpleNamespace(config=EngineConfig(), model_name="m", max_model_len=64,
                          runner=SimpleNamespace(model=SimpleNamespace(weight_forms=forms),
                                                 device="cpu"))
    info = server_info(llm)
    assert info["weights"] == forms
    json.dumps(info)
