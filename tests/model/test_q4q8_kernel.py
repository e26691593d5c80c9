"""The int8/int16-activation kernel (tokenmill/kernels/q4q8_gemv.c, `--quantization
gguf-a8` / `gguf-a16`) against float64 references, on the shapes of SmolLM2-135M's
linears and ragged rows.

Tolerances, per output element y = sum_k w_k x_k (w the dequantized GGUF weight):
- kernel vs the same quantized activations xq * dx: products and block sums are exact
  integers; what is left is fp32 scaling and the sum over <= 48 blocks, so
  |y - ref| <= 1e-5 (|x_deq| . |w|), plus the bf16 output rounding u |y| (u = 2^-8).
- vs the bf16 input itself: activation quantization moves each x_k by at most dx/2
  (round to nearest), so additionally |dy| <= sum_k dx_k / 2 |w_k|.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tokenmill.kernels import q4q8_gemv
from tokenmill.quant import Int4Linear, resolve_method, vnni
from tokenmill.quant.codes import dequantize_int4, int4_codes_from_gguf
from tokenmill.quant.linear import _q8_form

pytestmark = pytest.mark.skipif(not q4q8_gemv.available(), reason="q4q8_gemv not built")

U_BF16 = 2.0 ** -8
# (rows N, inputs K): fused qkv, o_proj, gate_up, down, and an LM head cut to 4096 rows
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576)]
RAGGED_ROWS = [1, 2, 3, 7]


def _weights(qtype, n, k, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    blocks = torch.from_numpy(gguf.quants.quantize(w, qtype))
    codes, scale, zero, repeats = int4_codes_from_gguf(blocks, qtype, (n, k))
    return codes, scale, zero, repeats, dequantize_int4(codes, scale, zero, repeats).double()


def _dequantized_input(x, bits):
    q, d, _ = q4q8_gemv.quantize(x, bits)
    m, k = x.shape
    return (q.double().reshape(m, -1, 32) * d.double()[..., None]).reshape(m, k), d


@pytest.mark.parametrize(("bits", "vmax"), [(8, 127), (16, 32512)])
@pytest.mark.parametrize("rows", RAGGED_ROWS)
def test_activation_quantization_is_round_to_nearest_per_block(rows, bits, vmax):
    x = (3 * torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))).bfloat16()
    q, d, total = q4q8_gemv.quantize(x, bits)
    blocks = x.float().reshape(rows, -1, 32)
    # d = max|x| / vmax to the last bit (-ffast-math may multiply by 1 / vmax instead)
    torch.testing.assert_close(d, blocks.abs().amax(-1) / vmax, rtol=2.5e-7, atol=0)
    expected = (blocks / d[..., None]).round().clamp(-vmax, vmax)
    # x * (1 / d) vs x / d may differ in the last bit, which moves a tie: never more than 1
    diff = (q.float().reshape(rows, -1, 32) - expected).abs()
    assert diff.max() <= 1 and diff.mean() < 1e-3
    assert torch.equal(total, q.reshape(rows, -1, 32).sum(-1, dtype=torch.int32))
    zeros = q4q8_gemv.quantize(torch.zeros(1, 64, dtype=torch.bfloat16), bits)
    assert zeros is not None and not zeros[0].any() and not zeros[1].any()


@pytest.mark.parametrize("bits", q4q8_gemv.BITS)
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize(("n", "k"), MODEL_SHAPES + [(100, 64)], ids=str)
def test_kernel_matches_the_dequantized_weight_on_the_same_quantized_inputs(qtype, n, k,
                                                                           bits):
    codes, scale, zero, repeats, w = _weights(qtype, n, k)
    packed, fmt = vnni.repack(codes, scale, zero, repeats)
    assert fmt == (q4q8_gemv.FORMAT_Q8 if qtype == Q.Q8_0 else q4q8_gemv.FORMAT_Q4)
    for rows in RAGGED_ROWS:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        xd, _ = _dequantized_input(x, bits)
        ref = xd @ w.T
        bound = 1e-5 * (xd.abs() @ w.abs().T) + 1e-30
        y32 = q4q8_gemv.linear(x, packed, n, fmt, torch.float32, bits)
        assert y32 is not None and y32.shape == (rows, n)
        assert ((y32.double() - ref).abs() <= bound).all()
        y16 = q4q8_gemv.linear(x, packed, n, fmt, bits=bits)
        assert y16.dtype == torch.bfloat16
        assert ((y16.double() - ref).abs() <= bound + U_BF16 * ref.abs()).all()


@pytest.mark.parametrize(("activations", "bits"), [("int8", 8), ("int16", 16)])
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", RAGGED_ROWS)
def test_int4_linear_with_quantized_activations_is_within_the_bound(qtype, rows, activations,
                                                                    bits):
    n, k = 960, 576
    codes, scale, zero, repeats, w = _weights(qtype, n, k, seed=2)
    linear = Int4Linear(codes, scale, zero, input_repeats=repeats, activations=activations)
    assert linear.activations == activations and not hasattr(linear, "packed")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).bfloat16()
    y = linear(x)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    exact = x.double() @ w.T
    _, d = _dequantized_input(x, bits)
    half_step = (d.double() / 2).repeat_interleave(32, dim=1)  # (rows, K)
    bound = (half_step @ w.abs().T) * 1.001 + 1e-5 * (x.double().abs() @ w.abs().T) \
        + U_BF16 * y.double().abs()
    assert ((y.double() - exact).abs() <= bound).all()
    # and the result is what the bf16-activation kernel gives: to a few per mille with
    # int8 inputs, to bf16's output rounding with int16
    bf16 = Int4Linear(codes, scale, zero, input_repeats=repeats)(x)
    rel = float((y.double() - bf16.double()).norm() / bf16.double().norm())
    assert rel < (0.02 if bits == 8 else 4e-3)
    assert torch.equal(linear(x.reshape(rows, 1, k)), y.reshape(rows, 1, n))  # 3-D input


def test_weights_with_no_exact_int8_form_keep_the_bf16_kernel():
    # Q4_1 rows in the Q8_0 form (fused with Q8_0 shards) have an offset per block
    codes, scale, zero, _, _ = _weights(Q.Q4_1, 32, 64)
    fused = _q8_form(codes, scale, zero)
    assert vnni.repack(*fused) is None
    linear = Int4Linear(*fused[:3], input_repeats=2, activations="int8")
    assert linear.activations == "bf16"
    with pytest.raises(ValueError, match="activations"):
        Int4Linear(codes, scale, zero, activations="int4")


def test_kernel_refuses_inputs_it_does_not_take():
    codes, scale, zero, repeats, _ = _weights(Q.Q4_1, 32, 64)
    packed, fmt = vnni.repack(codes, scale, zero, repeats)
    x = torch.randn(2, 64)
    assert q4q8_gemv.linear(x, packed, 32, fmt) is None  # fp32 input
    assert q4q8_gemv.linear(x.bfloat16().t().contiguous().t(), packed, 32, fmt) is None
    assert q4q8_gemv.linear(x.bfloat16(), packed, 48, fmt) is None  # wrong weight size
    assert q4q8_gemv.linear(x.bfloat16(), packed, 32, fmt, torch.float16) is None


def test_gguf_a8_needs_its_kernel(monkeypatch):
    model = torch.nn.Linear(64, 32)
    monkeypatch.setattr(vnni, "available", lambda: False)
    with pytest.raises(ValueError, match="gguf-a8"):
        resolve_method("gguf-a8", model)


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_threads_split_rows_without_changing_a_bit(threads):
    """Each thread takes its own run of the row groups, then what is left of the others'
    (8 threads on 2 cores: some are descheduled mid-run and the others take their
    groups): every output row computed once, with the one-thread bits."""
    codes, scale, zero, repeats, _ = _weights(Q.Q4_1, 3072 + 16 * 5 + 7, 576)
    n = codes.shape[0]
    packed, fmt = vnni.repack(codes, scale, zero, repeats)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = q4q8_gemv.linear(x, packed, n, fmt, bits=16)
        torch.set_num_threads(threads)
        for _ in range(5):
            assert torch.equal(q4q8_gemv.linear(x, packed, n, fmt, bits=16), one)
    finally:
        torch.set_num_threads(saved)


def _records(qtype, n, k):
    codes, scale, zero, repeats, _ = _weights(qtype, n, k)
    return vnni.repack(codes, scale, zero, repeats)


def _batch(rows, k, seed):
    """rows of activations as a prompt's are: mostly small, a few outlier channels, and
    a row of zeros (a block whose scale is 0)"""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, 7] *= 60
    x[rows // 2] = 0
    return x.bfloat16()


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize(("n", "k"), [(100, 96), (576, 1536), (4096, 576)], ids=str)
def test_many_rows_at_once_give_the_per_row_kernels_bits(qtype, n, k):
    """gemm16 (a prompt's rows; on AVX2 the records widened to int16 a few groups at a
    time) sums the same integers in the same fp32 order as the per-row kernel with
    16-bit activations: equal outputs at tile remainders (tiles of 6 rows), rows split
    between threads, ragged groups."""
    packed, fmt = _records(qtype, n, k)
    for rows in (1, 5, 6, 13, 20, 64, 131):
        x = _batch(rows, k, rows)
        for dtype in (torch.bfloat16, torch.float32):
            want = q4q8_gemv.linear(x, packed, n, fmt, dtype, bits=16)
            assert torch.equal(q4q8_gemv.gemm16(x, packed, n, fmt, dtype), want)


@pytest.mark.parametrize("rows, threads", [(70, 2), (38, 3), (40, 2)])
def test_many_rows_split_between_threads_without_changing_a_bit(rows, threads):
    """Many rows are (group block, run of tiles) items that the threads take as they
    come free, runs past the last tile included (7 tiles in 6 runs on 3 threads)."""
    packed, fmt = _records(Q.Q4_1, 3072, 576)
    x = _batch(rows, 576, 3)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = q4q8_gemv.gemm16(x, packed, 3072, fmt)
        torch.set_num_threads(threads)
        two = q4q8_gemv.gemm16(x, packed, 3072, fmt)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)


@pytest.mark.parametrize("march, isa", [("x86-64-v3", 1), ("x86-64-v2", 0)])
def test_every_isa_build_gives_the_bits_of_the_build_in_use(march, isa):
    """Built for AVX2 (-march=x86-64-v3: vpmaddubsw dot products) or for plain x86-64
    (-march=x86-64-v2: the plain-C loops), the kernel computes the same integer sums in
    the same fp32 order as the build in use (AVX512-VNNI on such a CPU), so the same fp32
    outputs, for every weight format, both activation precisions and ragged rows."""
    from tests.model.conftest import load_for_march

    lib = load_for_march(q4q8_gemv._lib, march)
    assert lib.tm_q4q8_has_vnni() == 0 and lib.tm_q4q8_isa() == isa
    fn = lib.tm_q4q8_linear
    for packed, fmt, n, k in _records_of_each_format():
        for bits in q4q8_gemv.BITS:
            # AVX2 passes of 4 rows: remainders 1 and 3; AVX512-VNNI passes of 16: one
            # pass of 11 or 16, then 1 or 8 rows left
            for rows in (1, 3, 5, 11, 16, 17, 24):
                x = (4 * torch.randn(rows, k, generator=torch.Generator().manual_seed(bits))
                     ).bfloat16()
                y = torch.empty(rows, n)
                assert fn(x.data_ptr(), rows, k, packed.data_ptr(), n, fmt, bits,
                          y.data_ptr(), 1, 1) == 0
                assert torch.equal(y, q4q8_gemv.linear(x, packed, n, fmt, torch.float32,
                                                       bits))
        # many rows at once (AVX2: widened records), or the per-row loops (plain C)
        gemm = lib.tm_q4q8_gemm16
        gemm.argtypes, gemm.restype = q4q8_gemv._lib.signatures["tm_q4q8_gemm16"]
        x = _batch(29, k, 2)
        y = torch.empty(29, n)
        assert gemm(x.data_ptr(), 29, k, packed.data_ptr(), n, fmt, y.data_ptr(), 1,
                    2) == 0
        assert torch.equal(y, q4q8_gemv.linear(x, packed, n, fmt, torch.float32, 16))


def _records_of_each_format():
    """(records, format, rows, inputs) of every record format: Q4 and Q8 from codes, Q5
    (Q5_0), Q6 (Q6_K in its opt-in 6-bit form) and Q4K (Q4_K, two super-blocks a row)
    from GGUF blocks, and a fused Q4K | Q6 and Q4K | Q8 (per-part formats; Q6_K's 6-bit
    and default 8-bit forms)."""
    from tests.model.test_gguf_kquant import _fused, _shard
    from tokenmill.quant import gguf_records

    for qtype in (Q.Q4_1, Q.Q8_0):
        codes, scale, zero, repeats, _ = _weights(qtype, 100, 96)
        yield (*vnni.repack(codes, scale, zero, repeats), 100, 96)
    for shards, small in (([_shard(Q.Q5_0, 100, 96)[0]], False),
                          ([_shard(Q.Q6_K, 100, 256)[0]], True),
                          ([_shard(Q.Q4_K, 100, 512)[0]], False),
                          (_fused((Q.Q4_K, Q.Q6_K), (32, 68))[0], True),
                          (_fused((Q.Q4_K, Q.Q6_K), (32, 68))[0], False)):
        saved, gguf_records.Q6_SMALL_FORM = gguf_records.Q6_SMALL_FORM, small
        try:
            packed, fmt, _ = gguf_records.repack_shards(shards)
        finally:
            gguf_records.Q6_SMALL_FORM = saved
        yield packed, fmt, 100, shards[0].shape[1]


@pytest.mark.parametrize("rows", RAGGED_ROWS + [8])
def test_silu_mul_forward_is_the_down_projection_of_silu_times_up(rows):
    from tokenmill.kernels import layer_ops

    codes, scale, zero, repeats, _ = _weights(Q.Q4_1, 576, 1536)  # down_proj's shape
    dense = dequantize_int4(codes, scale, zero).bfloat16()
    down = Int4Linear(codes, scale, zero, input_repeats=repeats, activations="int16",
                      dense_weight=dense, dense_min_rows=8)
    gate_up = (2 * torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows))
               ).bfloat16()
    act = layer_ops.silu_mul(gate_up)
    if act is None:
        gate, up = gate_up.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
    # one native call below 8 rows, the dense weight from 8: the same values either way
    assert torch.equal(down.silu_mul_forward(gate_up), down(act))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("rows", [16, 37])
def test_records_straight_from_gguf_bytes_are_the_records_of_the_codes(qtype, rows):
    """Loading builds the kernel's records from the GGUF bytes (vnni.repack_gguf), not
    through int32 codes: the same bytes as repacking the codes, padded rows included."""
    w = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).numpy()
    blocks = torch.from_numpy(gguf.quants.quantize(w, qtype))
    codes, scale, zero, repeats = int4_codes_from_gguf(blocks, qtype, (rows, 96))
    direct = vnni.repack_gguf(blocks, qtype, (rows, 96))
    via_codes = vnni.repack(codes, scale, zero, repeats)
    assert direct is not None and direct[1] == via_codes[1]
    assert torch.equal(direct[0], via_codes[0])
