"""Issue 22: the 8-bit KV cache in the native CPU kernel (paged_decode.c) against the
torch reference, which dequantizes: stores round-trip within each format's bound, and
decode over int8 / fp8 pools equals attention over the dequantized cache on mixed
batches, fragmented block tables and shared prefixes."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.attention import kv_quant
from tokenmill.kernels import paged_decode as native

needs_kernel = pytest.mark.skipif(not native.available(), reason="native kernel not built here")
FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
BLOCK = 4


def _pools(fmt, kv_heads, num_blocks, head_dim):
    shape = (kv_heads, num_blocks, BLOCK, head_dim)
    return (torch.zeros(shape, dtype=fmt.dtype), torch.zeros(shape, dtype=fmt.dtype),
            torch.zeros(shape[:3]), torch.zeros(shape[:3]))


def _tables(seq_lens, num_blocks, contiguous, shared, seed=0):
    rng = random.Random(seed)
    free = list(range(num_blocks))
    if not contiguous:
        rng.shuffle(free)
    common = [free.pop(0) for _ in range(shared)]
    return [common + [free.pop(0) for _ in range(-(-n // BLOCK) - shared)] for n in seq_lens]


def _filled(fmt, seq_lens, kv_heads, head_dim, contiguous, shared, store_native=True):
    """Pools holding every sequence's K/V, written as a run of steps would (each token once,
    shared blocks once), through the native store or the torch one."""
    num_blocks = 64
    tables = _tables(seq_lens, num_blocks, contiguous, shared)
    k_cache, v_cache, k_scale, v_scale = _pools(fmt, kv_heads, num_blocks, head_dim)
    slots = sorted({t[p // BLOCK] * BLOCK + p % BLOCK for t, n in zip(tables, seq_lens)
                    for p in range(n)})
    gen = torch.Generator().manual_seed(1)
    # rows with outliers and different magnitudes: a per-row scale must follow each
    k = torch.randn(len(slots), kv_heads, head_dim, generator=gen) * torch.rand(
        len(slots), kv_heads, 1, generator=gen) * 4
    v = torch.randn(len(slots), kv_heads, head_dim, generator=gen)
    k[::7, :, 3] *= 20
    k, v = k.bfloat16(), v.bfloat16()
    slot_t = torch.tensor(slots, dtype=torch.int64)
    if store_native:
        assert native.store_kv_q8(k, v, k_cache, v_cache, k_scale, v_scale, slot_t)
    else:
        kv_quant.store(k, v, k_cache, v_cache, k_scale, v_scale, slot_t, fmt)
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, k_scale, v_scale, table_t, tables


def _reference(q, k_cache, v_cache, k_scale, v_scale, tables, seq_lens, scale):
    """Attention over the dequantized cache, per sequence, in fp32."""
    k_deq = kv_quant.dequantize(k_cache, k_scale, torch.float32)
    v_deq = kv_quant.dequantize(v_cache, v_scale, torch.float32)
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
    group = q.shape[1] // kv_heads
    out = []
    for b, (table, n) in enumerate(zip(tables, seq_lens)):
        idx = torch.tensor(table[:-(-n // BLOCK)])
        k = k_deq[:, idx].reshape(kv_heads, -1, head_dim)[:, :n].repeat_interleave(group, 0)
        v = v_deq[:, idx].reshape(kv_heads, -1, head_dim)[:, :n].repeat_interleave(group, 0)
        p = torch.softmax((q[b].float()[:, None, :] @ k.transpose(1, 2))[:, 0] * scale, -1)
        out.append((p[:, None, :] @ v)[:, 0])
    return torch.stack(out)  # (B, heads, d)


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_within_the_format_bound(name):
    fmt = kv_quant.FORMATS[name]
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(40, 3, 64, generator=gen) * torch.logspace(-3, 2, 40)[:, None, None])
    x[5, 1, 7] = 300.0  # an outlier: only its own row's scale grows
    x[6, 2] = 0.0  # an all-zero row
    q, s = kv_quant.quantize(x, fmt)
    assert q.dtype == fmt.dtype and q.element_size() == 1 and s.shape == (40, 3)
    back = kv_quant.dequantize(q, s, torch.float32)
    absmax = x.abs().amax(-1, keepdim=True)
    bound = fmt.rel_error * x.abs() + fmt.abs_error_of_absmax * absmax + 1e-6 * absmax
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(back[6, 2], torch.zeros(64))
    # the outlier does not coarsen the other rows of its token
    assert (back[5, 0] - x[5, 0]).abs().max() <= fmt.abs_error_of_absmax * x[5, 0].abs().max() \
        + fmt.rel_error * x[5, 0].abs().max() + 1e-6


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
# 64: int8 rows in AVX2 registers where the CPU has them; 24: the plain loop. 50 tokens x 3
# heads: a prompt's rows, split between the threads
@pytest.mark.parametrize("head_dim,seq_lens", [(64, [7, 13]), (64, [7, 13, 30]),
                                               (24, [7, 13, 30])])
def test_native_store_equals_the_torch_store(name, head_dim, seq_lens):
    fmt = kv_quant.FORMATS[name]
    a = _filled(fmt, seq_lens, 3, head_dim, False, 0, store_native=True)
    b = _filled(fmt, seq_lens, 3, head_dim, False, 0, store_native=False)
    torch.testing.assert_close(a[2], b[2], rtol=1e-6, atol=0)  # the scales
    torch.testing.assert_close(a[3], b[3], rtol=1e-6, atol=0)
    for cache_a, cache_b, sc in ((a[0], b[0], a[2]), (a[1], b[1], a[3])):
        # equal bytes, but for a tie rounded the other way (x / s vs x * (1 / s))
        differ = cache_a.view(torch.uint8) != cache_b.view(torch.uint8)
        assert differ.float().mean() < 1e-3
        da = kv_quant.dequantize(cache_a, sc, torch.float32)
        db = kv_quant.dequantize(cache_b, sc, torch.float32)
        step = sc[..., None] * (1.0 if name == "int8" else 0.0) + da.abs() * fmt.rel_error * 2
        assert ((da - db).abs() <= step + 1e-7).all()


@needs_kernel
def test_native_store_refuses_a_slot_outside_the_pool():
    fmt = kv_quant.FORMATS["int8"]
    k_cache, v_cache, k_scale, v_scale = _pools(fmt, 2, 4, 32)
    k = torch.randn(2, 2, 32).bfloat16()
    assert not native.store_kv_q8(k, k, k_cache, v_cache, k_scale, v_scale,
                                  torch.tensor([3, 4 * BLOCK]))
    assert not k_cache.view(torch.uint8).any()  # nothing written


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64),  # SmolLM2: the AVX512 tiled scores where the CPU has it
    (8, 2, 128), (6, 2, 16),
    (4, 1, 24),  # head_dim not a multiple of 16: the plain C loops
])
@pytest.mark.parametrize("contiguous,shared", [(True, 0), (False, 0), (False, 3)])
def test_native_decode_matches_the_dequantized_reference(name, heads, kv_heads, head_dim,
                                                         contiguous, shared):
    fmt = kv_quant.FORMATS[name]
    seq_lens = [23, 61, 21, 40, 13]  # mixed, not multiples of the block size
    k_cache, v_cache, k_scale, v_scale, table_t, tables = _filled(
        fmt, seq_lens, kv_heads, head_dim, contiguous, shared)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen).bfloat16()
    scale = head_dim ** -0.5
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scratch = torch.empty(len(seq_lens) * heads * max(seq_lens))
    out, _, _ = native.paged_decode_q8(q, k_cache, v_cache, k_scale, v_scale, table_t, 0, lens,
                                       max(seq_lens), scale, scratch)
    assert out.dtype == torch.bfloat16
    ref = _reference(q, k_cache, v_cache, k_scale, v_scale, tables, seq_lens, scale)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert (out.float() - ref).abs().mean() < 1.5e-3
    if shared:
        # the shared prefix split off, as the decode path attends it once for the batch:
        # the kernel's (sum, max, denominator) over the rest merges back to the whole
        rest = torch.tensor([n - shared * BLOCK for n in seq_lens], dtype=torch.int32)
        part, m, l_ = native.paged_decode_q8(q, k_cache, v_cache, k_scale, v_scale, table_t,
                                             shared, rest, max(seq_lens), scale, scratch,
                                             with_lse=True)
        pre = _reference(q, k_cache, v_cache, k_scale, v_scale,
                         [t[:shared] for t in tables], [shared * BLOCK] * len(tables), scale)
        k_deq = kv_quant.dequantize(k_cache, k_scale, torch.float32)
        idx = torch.tensor(tables[0][:shared])
        kp = k_deq[:, idx].reshape(kv_heads, -1, head_dim).repeat_interleave(heads // kv_heads,
                                                                             0)
        s_pre = torch.einsum("bhd,htd->bht", q.float(), kp) * scale  # (B, heads, P)
        m_pre = s_pre.amax(-1)
        l_pre = torch.exp(s_pre - m_pre[..., None]).sum(-1)
        mm = torch.maximum(m, m_pre)
        w_rest, w_pre = torch.exp(m - mm), l_pre * torch.exp(m_pre - mm)
        merged = (part * w_rest[..., None] + pre * w_pre[..., None]) / (
            l_ * w_rest + w_pre)[..., None]
        torch.testing.assert_close(merged, ref, atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (6, 2, 16),
                                                     (4, 1, 24)])
def test_the_avx2_build_decodes_8bit_pools_as_the_reference(name, heads, kv_heads, head_dim):
    """paged_decode.c built for -march=x86-64-v3 (no AVX-512: the Zen 3 machines' path,
    which an AVX-512 CI machine does not take otherwise): the 8-bit scores and values in
    AVX2 registers (int8 converted, fp8 codes' bits moved into fp32, subnormals among
    them) against the dequantized reference, on fragmented tables and partial blocks."""
    from tests.model.conftest import load_for_march

    fn = load_for_march(native._lib).tm_paged_decode_q8
    fmt = kv_quant.FORMATS[name]
    seq_lens = [23, 61, 21, 40, 13, 1]
    k_cache, v_cache, k_scale, v_scale, table_t, tables = _filled(
        fmt, seq_lens, kv_heads, head_dim, False, 0)
    gen = torch.Generator().manual_seed(3)
    q = (torch.randn(len(seq_lens), heads, head_dim, generator=gen) * 3).bfloat16()
    scale = head_dim ** -0.5
    pools = (k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
             fmt.native_code)
    out = native._decode(fn, q, pools, k_cache.shape, table_t, 0,
                         torch.tensor(seq_lens, dtype=torch.int32), max(seq_lens), scale,
                         torch.empty(len(seq_lens) * heads * max(seq_lens)), False)
    assert out is not None
    ref = _reference(q, k_cache, v_cache, k_scale, v_scale, tables, seq_lens, scale)
    torch.testing.assert_close(out[0].float(), ref, atol=2e-2, rtol=2e-2)
    assert (out[0].float() - ref).abs().mean() < 1.5e-3


@needs_kernel
def test_native_decode_reads_no_slot_past_a_sequence():
    fmt = kv_quant.FORMATS["int8"]
    seq_lens = [5, 17, 9]
    k_cache, v_cache, k_scale, v_scale, table_t, tables = _filled(fmt, seq_lens, 3, 64, False,
                                                                  0)
    q = torch.randn(3, 9, 64).bfloat16()
    ref = _reference(q, k_cache, v_cache, k_scale, v_scale, tables, seq_lens, 0.125)
    written = torch.zeros(k_scale.shape[1:], dtype=torch.bool)
    for table, n in zip(tables, seq_lens):
        for p in range(n):
            written[table[p // BLOCK], p % BLOCK] = True
    k_scale[:, ~written] = float("nan")
    v_scale[:, ~written] = float("nan")
    out, _, _ = native.paged_decode_q8(q, k_cache, v_cache, k_scale, v_scale, table_t, 0,
                                       torch.tensor(seq_lens, dtype=torch.int32), 17, 0.125,
                                       torch.empty(3 * 9 * 17))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_formats_take_vllm_names():
    assert kv_quant.kv_format("fp8") is kv_quant.FORMATS["fp8_e4m3"]
    assert kv_quant.kv_format("auto") is None and kv_quant.kv_format("bfloat16") is None
    with pytest.raises(ValueError, match="kv cache dtype"):
        kv_quant.kv_format("int4")
