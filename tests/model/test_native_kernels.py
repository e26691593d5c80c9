"""The native kernels (tokenmill/kernels): built where a compiler exists, equal to
the torch code they replace (paged decode attention against the reference, the
fused layer ops against the torch ops), and never required."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from tests.model.test_attention_fast import mixed_step
from tokenmill.attention import cpu as attention_fast
from tokenmill.attention.cpu import _DecodePlan, paged_attention_fast, store_kv_cache
from tokenmill.attention.torch_ref import kv_cache_shape, paged_attention_reference
from tokenmill.kernels import build, layer_ops
from tokenmill.kernels import paged_decode as native
from tokenmill.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul


def assert_bf16_close(fast: torch.Tensor, ref: torch.Tensor) -> None:
    """Within bf16 rounding of the output and of the softmax weights, elementwise and
    on average (a wrong block or merge weight moves the mean far more)."""
    torch.testing.assert_close(fast, ref, atol=2e-2, rtol=2e-2)
    assert (fast - ref).abs().mean() < 1.5e-3


needs_kernel = pytest.mark.skipif(not native.available(), reason="native kernel not built here")


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """Builds into an empty cache and forgets what earlier tests loaded."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    build.load.cache_clear()
    yield tmp_path
    build.load.cache_clear()


def test_kernel_builds_where_a_compiler_exists():
    # a broken C file must fail the suite, not silently fall back to the torch path
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    assert native.available()


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64),  # SmolLM2-135M: the AVX512-BF16 path where the CPU has it
    (8, 2, 128),  # Llama-3-8B's grouping and head size
    (4, 4, 32),  # no grouping
    (6, 2, 16),  # head_dim not a multiple of 32: the plain C loops
    (16, 2, 128),  # 8 x 128 per kv head: the vector path with its operands spilled
    (10, 1, 64),  # one kv head for ten query heads
])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("shared", [0, 5])
def test_native_decode_matches_reference(heads, kv_heads, head_dim, contiguous, shared,
                                        monkeypatch):
    monkeypatch.setattr(attention_fast, "MIN_CASCADE_BLOCKS", 1)  # the kernel at this size
    monkeypatch.setattr(attention_fast, "MIN_CASCADE_SEQS", 1)
    seq_lens = [23, 61, 21, 40, 33]  # not multiples of the block size
    q, k, v, k_cache, v_cache, meta = mixed_step([1] * 5, seq_lens, torch.bfloat16,
                                                 contiguous, shared=shared, heads=heads,
                                                 kv_heads=kv_heads, head_dim=head_dim)
    plan = _DecodePlan(meta.block_tables, seq_lens, k_cache)
    assert plan.native and plan.shared == shared  # the paths under test are the ones taken
    scale = head_dim ** -0.5
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    fast = paged_attention_fast(q, k, v, k_cache, v_cache, meta, scale).float()
    assert_bf16_close(fast, ref)


def check_peaked_decode(decode, heads: int, kv_heads: int, head_dim: int) -> None:
    """decode(q, k_cache, v_cache, tables, lens, max_len, scale, scratch) -> (B, H, D) over
    blocks of 16 tokens, as the engine allocates them, lengths 1..200 (whole tiles and
    partial ones, a block's first token alone) in a shuffled pool, against the
    reference. Queries scaled so that the softmax is peaked (on random unit data it is
    near uniform, and a score that drops half of head_dim still passed)."""
    torch.manual_seed(0)
    bs, lens = 16, [1, 15, 16, 17, 33, 200]
    blocks = sum(-(-n // bs) for n in lens)
    k_cache = torch.randn(kv_heads, blocks + 3, bs, head_dim).to(torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(blocks + 3)[:blocks].to(torch.int32)
    width = max(-(-n // bs) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(lens):
        nb = -(-n // bs)
        tables[b, :nb] = perm[at:at + nb]
        at += nb
    q = (3 * torch.randn(len(lens), heads, head_dim)).to(torch.bfloat16)
    scale = head_dim ** -0.5
    scratch = torch.empty(len(lens) * heads * max(lens), dtype=torch.float32)
    got = decode(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32),
                 max(lens), scale, scratch).float()
    group = heads // kv_heads
    for b, n in enumerate(lens):
        rows = tables[b, :-(-n // bs)].long()
        k = k_cache[:, rows].reshape(kv_heads, -1, head_dim)[:, :n].float()
        v = v_cache[:, rows].reshape(kv_heads, -1, head_dim)[:, :n].float()
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        p = torch.softmax(torch.einsum("hd,htd->ht", q[b].float(), k) * scale, -1)
        assert p.max() > min(0.5, 20 / n)  # peaked (uniform is 1 / n): the scores matter
        ref = torch.einsum("ht,htd->hd", p, v)
        assert_bf16_close(got[b], ref)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128)])
def test_native_decode_whole_tiles_of_16_tokens_match_the_reference(heads, kv_heads,
                                                                    head_dim):
    """The build in use: the scores run whole tiles of 16 keys (their own unrolled loop
    on AVX-512) and partial ones."""
    def decode(q, k_cache, v_cache, tables, lens, max_len, scale, scratch):
        return native.paged_decode(q, k_cache, v_cache, tables, 0, lens, max_len, scale,
                                   scratch)[0]

    check_peaked_decode(decode, heads, kv_heads, head_dim)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64), (6, 3, 64), (3, 3, 64),  # SmolLM2's groups of 3, and the 2 and 1 of a split
    (8, 2, 128),  # 4 query heads per kv head: a tile of 3 heads, then one of 1
    (28, 4, 96),  # 7 per kv head, head_dim 96: the shapes without their own compile-time copy
])
def test_avx2_decode_matches_the_reference(heads, kv_heads, head_dim):
    """paged_decode.c built for AVX2 without AVX-512 (-march=x86-64-v3: the path of the
    Zen 3 machines, which the AVX-512 CI machine does not take otherwise): q . k on pairs
    of bf16 widened in registers, 4 tokens x up to 3 heads at a time, the weighted sum
    of V in tiles of 3 heads x 16 dims, against the reference."""
    from tests.model.conftest import load_for_march

    fn = load_for_march(native._lib).tm_paged_decode_bf16

    def decode(q, k_cache, v_cache, tables, lens, max_len, scale, scratch):
        out = native._decode(fn, q, (k_cache.data_ptr(), v_cache.data_ptr()), k_cache.shape,
                             tables, 0, lens, max_len, scale, scratch, False)
        assert out is not None
        return out[0]

    check_peaked_decode(decode, heads, kv_heads, head_dim)


@needs_kernel
def test_native_decode_reads_only_each_sequences_own_tokens():
    # slots past a sequence's end may hold anything (here NaN); the kernel never reads them
    seq_lens = [5, 17, 9]
    q, k, v, k_cache, v_cache, meta = mixed_step([1] * 3, seq_lens, torch.bfloat16, False,
                                                 heads=9, kv_heads=3, head_dim=64)
    written = torch.zeros(k_cache.shape[1:3], dtype=torch.bool)
    for table, n in zip(meta.block_tables.tolist(), seq_lens):
        for p in range(n):
            written[table[p // 4], p % 4] = True
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    k_cache[:, ~written] = float("nan")
    v_cache[:, ~written] = float("nan")
    fast = paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.125).float()
    assert_bf16_close(fast, ref)


def test_no_compiler_or_switched_off_means_the_torch_path(monkeypatch, fresh_build):
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))
    assert build.load("paged_decode") is None
    build.load.cache_clear()
    monkeypatch.delenv("CC")
    monkeypatch.setenv("TOKENMILL_NATIVE", "0")
    assert not native.available()
    seq_lens = [23, 30, 21]
    q, k, v, k_cache, v_cache, meta = mixed_step([1] * 3, seq_lens, torch.bfloat16, False)
    assert not _DecodePlan(meta.block_tables, seq_lens, k_cache).native
    ref = paged_attention_reference(q, k_cache, v_cache, meta, 0.25).float()
    fast = paged_attention_fast(q, k, v, k_cache, v_cache, meta, 0.25).float()
    torch.testing.assert_close(fast, ref, atol=2e-2, rtol=2e-2)
    assert not layer_ops.available()
    x = torch.randn(2, 64).bfloat16()
    assert layer_ops.rms_norm(x, torch.ones(64).bfloat16(), 1e-5) is None
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.ones(64).bfloat16()
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.equal(norm(x), expected)  # the torch ops, as before the kernels


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_a_build_is_reused_from_the_cache(fresh_build):
    assert build.load("paged_decode") is not None
    (so,) = (fresh_build / "kernels").glob("paged_decode-*.so")
    built_at = so.stat().st_mtime_ns
    build.load.cache_clear()  # a new process: finds the shared object, does not rebuild
    assert build.load("paged_decode") is not None
    assert [p.stat().st_mtime_ns for p in (fresh_build / "kernels").glob("*.so")] == [built_at]


def test_decode_plans_use_the_kernel_only_for_bf16_caches():
    _, _, _, k_cache, _, meta = mixed_step([1, 1], [9, 13], torch.float32, True)
    assert not _DecodePlan(meta.block_tables, [9, 13], k_cache).native  # fp32: exact path
    assert attention_fast.use_native(k_cache.bfloat16()) == native.available()


# --- fused per-layer ops (layer_ops.c) against the torch ops they replace ---

needs_layer_ops = pytest.mark.skipif(not layer_ops.available(),
                                     reason="layer ops not built here")


@pytest.fixture
def torch_ops(monkeypatch):
    """Run a callable with the fused kernels switched off: the plain torch path."""
    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(layer_ops._lib, "get", lambda name: None)
            return fn(*args)
    return run


def assert_within_one_bf16_ulp(fast: torch.Tensor, ref: torch.Tensor, ulps: int = 1) -> None:
    """Equal but for fp32 sums in another order: a rare last-bit difference."""
    assert fast.dtype == ref.dtype == torch.bfloat16 and fast.shape == ref.shape
    a, b = fast.view(torch.int16).int(), ref.view(torch.int16).int()
    assert (a - b).abs().max() <= ulps
    assert (a != b).float().mean() < 0.01


@needs_layer_ops
@pytest.mark.parametrize("rows", [1, 5, 40])  # 40: split across threads
def test_fused_rms_norm_and_residual_add_match_torch(rows, torch_ops):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(576, generator=gen)).bfloat16()
    x = (3 * torch.randn(rows, 576, generator=gen)).bfloat16()
    residual = torch.randn(rows, 576, generator=gen).bfloat16()
    assert_within_one_bf16_ulp(norm(x), torch_ops(norm, x))
    ref_out, ref_res = torch_ops(norm.add_forward, x.clone(), residual.clone())
    out, res = norm.add_forward(x.clone(), residual.clone())
    assert torch.equal(res, ref_res)  # the residual stream: exactly x + residual in bf16
    assert_within_one_bf16_ulp(out, ref_out)


@needs_layer_ops
@pytest.mark.parametrize("tokens", [1, 7, 48])
def test_fused_rotary_matches_torch_in_place_on_a_strided_view(tokens, torch_ops):
    gen = torch.Generator().manual_seed(tokens)
    rotary = RotaryEmbedding(64, 2048, 10000.0)
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    qkv = torch.randn(tokens, 15 * 64, generator=gen).bfloat16()  # [q 9 | k 3 | v 3] heads
    qk = qkv[:, :12 * 64].unflatten(-1, (12, 64))  # a view with the fused row stride
    ref = torch_ops(rotary.rotate, positions, qk.clone())
    v_before = qkv[:, 12 * 64:].clone()
    out = rotary.rotate(positions, qk)
    assert out.data_ptr() == qk.data_ptr()  # in place: no copy of q and k
    assert torch.equal(qkv[:, 12 * 64:], v_before)  # v, beside it in the row, untouched
    assert_within_one_bf16_ulp(out, ref)


@needs_layer_ops
@pytest.mark.parametrize("rows", [1, 16])
def test_fused_silu_mul_matches_torch(rows, torch_ops):
    gate_up = (4 * torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(0))
               ).bfloat16()
    # silu(5.9375) = 5.9218745 sits a hair below a bf16 rounding tie: libmvec's expf can
    # land it on the other side, a last bit that the product with up can double
    assert_within_one_bf16_ulp(silu_and_mul(gate_up), torch_ops(silu_and_mul, gate_up), ulps=2)


@needs_layer_ops
def test_native_geglu_is_gelu_tanh_times_up_within_bf16_rounding():
    """Gemma's GeGLU on bf16 rows: gelu(gate, approximate="tanh") * up computed in fp32
    and rounded as the module path rounds it (gelu to bf16, then the product), within a
    bf16 ulp of each rounding; large negative gates give -0 / tiny values, not NaN."""
    gate_up = (4 * torch.randn(16, 2 * 2048, generator=torch.Generator().manual_seed(0))
               ).bfloat16()
    gate_up[0, :6] = torch.tensor([-100.0, -20.0, 0.0, 1e-30, 20.0, 100.0])
    gate, up = gate_up.double().chunk(2, dim=-1)  # fp64: no cancellation in 1 + tanh
    want = F.gelu(gate, approximate="tanh") * up
    got = layer_ops.gelu_tanh_mul(gate_up)
    assert got is not None and not got.isnan().any()
    # two bf16 roundings (the gelu, then the product): each within 2^-9 relative; where
    # the gelu is below 1e-6 (gates under about -5) its fp32 e^x rounds differently
    torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-6)
    assert layer_ops.gelu_tanh_mul(gate_up.float()) is None  # fp32: torch's


@needs_layer_ops
def test_native_argmax_picks_what_torch_argmax_picks():
    """Greedy sampling's argmax: the first of equal maxima, a NaN as the largest (the
    first NaN), -0.0 equal to 0.0, a row of -inf, and SmolLM2's vocabulary size."""
    rows = torch.randn(6, 49152, generator=torch.Generator().manual_seed(1))
    rows[1, [7, 300, 40000]] = 9.0  # a tie: the first
    rows[2, 5000], rows[2, 9000], rows[2, 100] = float("nan"), float("nan"), 50.0
    rows[3] = float("-inf")
    rows[4] = -1.0
    rows[4, 20], rows[4, 10] = 0.0, -0.0  # -0.0 equals 0.0: index 10
    rows[5, -1] = float("inf")
    want = rows.argmax(dim=-1)
    assert want.tolist()[1:5] == [7, 5000, 0, 10]
    assert torch.equal(layer_ops.argmax(rows), want)
    assert torch.equal(layer_ops.argmax(rows[:1, :3].contiguous()), rows[:1, :3].argmax(-1))
    assert layer_ops.argmax(rows.bfloat16()) is None  # not fp32: torch's
    assert layer_ops.argmax(rows[:, ::2]) is None  # not contiguous: torch's


def _torch_draws(logits: torch.Tensor, temps: list[float], u: torch.Tensor) -> torch.Tensor:
    from tokenmill.engine.core.sampling_ops import inverse_cdf_draw

    return inverse_cdf_draw(torch.softmax(logits / torch.tensor(temps)[:, None], -1), u)


@needs_layer_ops
@pytest.mark.parametrize("march", ["in use", "x86-64-v3", "x86-64-v2"])
def test_native_draw_takes_the_token_torchs_draw_takes(march):
    """Random sampling without filters (what a request with only a temperature gets):
    with the same uniforms, the native draw (the build in use, and the AVX2 and plain-C
    builds) takes torch's softmax + inverse-CDF token on all but the rare row whose
    uniform falls within the sums' rounding of a boundary, at T = 1 and T = 0.7, a
    vocabulary not a multiple of its blocks; never a token of logit -inf; and leaves
    NaN rows to torch."""
    from tokenmill.cpuinfo import cpu_flags

    if march == "in use":
        fn = layer_ops._lib.get("tm_sample_f32")
    else:
        if march == "x86-64-v3" and not {"avx2", "fma", "f16c"} <= cpu_flags():
            pytest.skip("this CPU cannot run an x86-64-v3 build")
        fn = _layer_ops_build(march).tm_sample_f32

    def draw(x, temps, u):
        out = torch.empty(x.shape[0], dtype=torch.int64)
        t = torch.tensor(temps)  # held: a temporary's memory is freed before the call
        fn(x.data_ptr(), x.shape[0], x.shape[1], t.data_ptr(), u.data_ptr(), out.data_ptr(), 2)
        return out

    gen = torch.Generator().manual_seed(7)
    x = 4 * torch.randn(64, 50_001, generator=gen)
    x[:, 1000:1500] = float("-inf")  # masked tokens (min_tokens, a stop id)
    before = x.clone()
    agree = total = 0
    for temps in ([1.0] * 64, [0.7] * 64):
        for _ in range(10):
            u = torch.rand(64, generator=gen)
            got = draw(x, temps, u)
            assert not ((got >= 1000) & (got < 1500)).any()
            assert ((got >= 0) & (got < x.shape[1])).all()
            agree += int((got == _torch_draws(x, temps, u)).sum())
            total += 64
    assert agree >= 0.995 * total, (agree, total)
    assert torch.equal(x, before)
    one = torch.full((1, 5000), float("-inf"))
    one[0, 4321] = -3.0  # one token left: always it
    assert draw(one, [1.0], torch.tensor([0.999])).item() == 4321
    assert draw(one, [1.0], torch.tensor([0.0])).item() == 4321
    nan = torch.randn(2, 300)
    nan[1, 7] = float("nan")
    assert draw(nan, [1.0, 1.0], torch.rand(2))[1].item() == -1
    if march == "in use":  # the wrapper: torch's path for such a row
        assert layer_ops.sample(nan, [1.0, 1.0], torch.rand(2)) is None


def test_fused_ops_leave_float32_to_torch():
    x = torch.randn(3, 64)
    assert layer_ops.rms_norm(x, torch.ones(64), 1e-5) is None
    assert layer_ops.silu_mul(torch.randn(3, 128)) is None
    assert not layer_ops.rotary_(x.view(3, 1, 64), torch.arange(3), torch.ones(8, 64),
                                 torch.ones(8, 64))


@needs_kernel
def test_native_kv_store_writes_what_index_copy_writes_from_strided_rows():
    gen = torch.Generator().manual_seed(0)
    tokens, kv_heads, d, blocks = 7, 3, 64, 16
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * d, generator=gen).bfloat16()
    k = qkv[:, 9 * d:12 * d].unflatten(-1, (kv_heads, d))  # rows 15 * d apart, as in the model
    v = qkv[:, 12 * d:].unflatten(-1, (kv_heads, d))
    slots = torch.randperm(blocks * 4, generator=gen)[:tokens]
    shape = kv_cache_shape(blocks, 4, kv_heads, d)
    k_cache, v_cache = torch.zeros(shape).bfloat16(), torch.zeros(shape).bfloat16()
    assert native.store_kv(k, v, k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros(shape).bfloat16(), torch.zeros(shape).bfloat16()
    k_ref.view(kv_heads, -1, d).index_copy_(1, slots, k.transpose(0, 1))
    v_ref.view(kv_heads, -1, d).index_copy_(1, slots, v.transpose(0, 1))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # a slot past the pool: nothing written, and the caller's torch path raises
    bad = slots.clone()
    bad[3] = blocks * 4
    before = k_cache.clone()
    assert not native.store_kv(k, v, k_cache, v_cache, bad)
    assert torch.equal(k_cache, before)
    with pytest.raises(IndexError):
        store_kv_cache(k, v, k_cache, v_cache, bad)


@needs_kernel
def test_native_decode_reads_q_in_place_from_the_fused_qkv_rows():
    seq_lens = [23, 61, 21]
    q, k, v, k_cache, v_cache, meta = mixed_step([1] * 3, seq_lens, torch.bfloat16, False,
                                                 heads=9, kv_heads=3, head_dim=64)
    wide = torch.cat([q.flatten(1), torch.randn(3, 6 * 64).bfloat16()], dim=1)
    q_view = wide[:, :9 * 64].unflatten(-1, (9, 64))  # rows 15 * 64 apart
    assert not q_view.is_contiguous()
    scale = 0.125
    assert torch.equal(paged_attention_fast(q_view, k, v, k_cache, v_cache, meta, scale),
                       paged_attention_fast(q, k, v, k_cache, v_cache, meta, scale))


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_loading_the_kernels_leaves_the_process_floating_point_mode_alone(fresh_build):
    # a library linked with -ffast-math turns on flush-to-zero for the whole process
    # as it loads (gcc's crtfastmath.o): every float op of the server would change
    tiny = 1e-310
    assert tiny / 1e5 != 0.0
    assert build.load("paged_decode") is not None and build.load("layer_ops") is not None
    assert tiny / 1e5 != 0.0


def _layer_ops_build(march: str):
    """layer_ops.c built as a CPU without AVX-512 builds it (strict fp32), for `march`."""
    from tests.model.conftest import load_for_march

    return load_for_march(layer_ops._lib, march)


@needs_layer_ops
@pytest.mark.parametrize("hidden", [576, 100])  # 100: a partial last step of 16 and of 8
def test_avx2_norm_and_silu_give_the_bits_of_the_build_in_use(hidden):
    """Built for AVX2 (-march=x86-64-v3: vec_math.h's 8-lane e^x, norms and sums), the
    RMSNorm (with and without the residual add) and silu * up compute the AVX-512
    versions' steps on two 8-lane halves: the same bits as the build in use on any
    x86 CPU that runs it (AVX-512 or AVX2), tails included. The plain-C build
    (x86-64-v2) keeps the same RMSNorm bits too (its sum runs in the same 16 lanes)."""
    from tokenmill.cpuinfo import cpu_flags

    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    gen = torch.Generator().manual_seed(hidden)
    rows = 3
    x = (3 * torch.randn(rows, hidden, generator=gen)).bfloat16()
    residual = torch.randn(rows, hidden, generator=gen).bfloat16()
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16()
    gate_up = (4 * torch.randn(rows, 2 * hidden, generator=gen)).bfloat16()
    gate_up[0, :8] = torch.tensor([-100.0, -87.5, 88.0, 0.0, -0.0, 5.9375, 1e-30, -3.0])

    def run(lib):
        out = torch.empty_like(x)
        lib.tm_rms_norm_bf16(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), rows,
                             hidden, 1e-5, 1)
        xa, ra = x.clone(), residual.clone()
        lib.tm_rms_norm_bf16(xa.data_ptr(), ra.data_ptr(), weight.data_ptr(), xa.data_ptr(),
                             rows, hidden, 1e-5, 1)
        act = torch.empty(rows, hidden, dtype=torch.bfloat16)
        lib.tm_silu_mul_bf16(gate_up.data_ptr(), act.data_ptr(), rows, hidden, 1)
        gelu = torch.empty(rows, hidden, dtype=torch.bfloat16)  # Gemma's GeGLU
        lib.tm_gelu_tanh_mul_bf16(gate_up.data_ptr(), gelu.data_ptr(), rows, hidden, 1)
        return out, xa, ra, act, gelu

    in_use = layer_ops._lib.get("tm_rms_norm_bf16")
    assert in_use is not None
    ref_out = layer_ops.rms_norm(x, weight, 1e-5)
    ref_res = residual.clone()
    ref_added = layer_ops.rms_norm(x.clone(), weight, 1e-5, ref_res)
    ref_act = layer_ops.silu_mul(gate_up)
    ref_gelu = layer_ops.gelu_tanh_mul(gate_up)
    out, added, res, act, gelu = run(_layer_ops_build("x86-64-v3"))
    assert torch.equal(out, ref_out) and torch.equal(added, ref_added)
    assert torch.equal(res, ref_res) and torch.equal(act, ref_act)
    assert torch.equal(gelu, ref_gelu)
    out, added, res, _, _ = run(_layer_ops_build("x86-64-v2"))
    assert torch.equal(out, ref_out) and torch.equal(added, ref_added)
    assert torch.equal(res, ref_res)


def test_every_native_kernel_builds_where_a_compiler_exists():
    """A C file that no longer compiles (a merge that left a struct member behind) made
    every fused-decode, MoE and LoRA test skip instead of fail: each kernel library must
    build and agree with its Python record layout here."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    from tokenmill.kernels import decode_step, q4q8_gemv

    assert decode_step.available(), "decode_step.c did not build or its ABI disagrees"
    assert q4q8_gemv.available(), "q4q8_gemv.c did not build"
