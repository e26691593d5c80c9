"""Issue 22: attention over an 8-bit KV cache (attention/quantized.py) through the path the
model takes (store, then attend) equals the torch reference over the dequantized cache:
decode-only steps (the native kernel), mixed steps of prompt chunks and decodes, shared
prefixes and fragmented tables, on the CPU route and the reference route."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.attention import kv_quant, quantized
from tokenmill.attention.cpu import CpuBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.torch_ref import TorchBackend, paged_attention_reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 4


def _step(fmt, query_lens, seq_lens, shared=0, contiguous=False, seed=0):
    """A cache holding each sequence's prefix, then this step's tokens stored through the
    quantized store as the model does; returns what attend() needs."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 96
    free = list(range(1, num_blocks))  # block 0 pads tables, as in the runner
    if not contiguous:
        rng.shuffle(free)
    common = [free.pop(0) for _ in range(shared)]
    tables = [common + [free.pop(0) for _ in range(-(-n // BLOCK) - shared)] for n in seq_lens]
    shape = (KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    kc, vc = (quantized.QuantizedPool.allocate(fmt, shape, torch.device("cpu"), torch.zeros)
              for _ in range(2))
    backend = quantized.QuantizedKVBackend(CpuBackend(torch.device("cpu"), torch.bfloat16), fmt)
    prefix_slots = sorted({t[p // BLOCK] * BLOCK + p % BLOCK
                           for t, ql, n in zip(tables, query_lens, seq_lens)
                           for p in range(n - ql)})
    if prefix_slots:
        kp = torch.randn(len(prefix_slots), KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
        vp = torch.randn(len(prefix_slots), KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
        backend.store_kv(kp, vp, kc, vc, _slots_only(torch.tensor(prefix_slots)))
    total = sum(query_lens)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen).bfloat16()
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    slots, starts = [], [0]
    for t, ql, n in zip(tables, query_lens, seq_lens):
        slots += [t[p // BLOCK] * BLOCK + p % BLOCK for p in range(n - ql, n)]
        starts.append(starts[-1] + ql)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        block_size=BLOCK, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_list=list(query_lens), seq_lens_list=list(seq_lens))
    backend.store_kv(k, v, kc, vc, meta)  # as the model does: store, then attend
    return q, k, v, (kc, vc), meta


def _slots_only(slots):
    return AttentionMetadata(slot_mapping=slots, query_start_loc=None, seq_lens=None,
                             block_tables=None, block_size=BLOCK, max_query_len=0,
                             max_seq_len=0, query_lens_list=[], seq_lens_list=[])


def _reference(q, cache, meta):
    """The torch reference over the dequantized cache, in fp32."""
    k = kv_quant.dequantize(cache[0].data, cache[0].scale, torch.float32)
    v = kv_quant.dequantize(cache[1].data, cache[1].scale, torch.float32)
    return paged_attention_reference(q.float(), k, v, meta, HEAD_DIM ** -0.5)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("query_lens,seq_lens,shared", [
    ([1] * 5, [23, 61, 21, 40, 33], 0),  # decode only: the native kernel on the CPU route
    ([1] * 4, [30, 41, 25, 50], 5),  # decode only, a shared cached prompt
    ([1, 7, 1, 12], [19, 30, 26, 12], 0),  # mixed: decodes, a chunk after a prefix, a prompt
    ([1, 9, 1], [31, 40, 29], 6),  # mixed with a shared prefix
])
def test_quantized_attention_matches_the_dequantized_reference(name, reference, query_lens,
                                                               seq_lens, shared):
    fmt = kv_quant.FORMATS[name]
    q, k, v, cache, meta = _step(fmt, query_lens, seq_lens, shared)
    out = quantized.attend(q, k, v, *cache, meta, HEAD_DIM ** -0.5, reference=reference)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = _reference(q, cache, meta)
    # a whole prompt attends to its own fresh K/V on the CPU route (as the bf16 path
    # does): within the format's rounding of those keys, not bit-equal
    exact_rows = torch.tensor([ql != n for ql, n in zip(query_lens, seq_lens)
                               for _ in range(ql)])
    tol = 2e-2 if name != "fp8_e5m2" else 6e-2
    torch.testing.assert_close(out.float()[exact_rows], ref[exact_rows], atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), ref, atol=0.25, rtol=0.25)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_a_decode_row_reads_the_same_whether_a_prompt_shares_its_step(name):
    # a mixed step's single-token rows go to the 8-bit kernel over the pools, as a
    # decode-only step's do (not through a dequantized bf16 copy of their blocks), and
    # the prompt rows keep the dequantized path
    fmt = kv_quant.FORMATS[name]
    q, k, v, cache, meta = _step(fmt, [1, 7, 1, 12, 1], [19, 30, 26, 12, 40])
    out = quantized.attend(q, k, v, *cache, meta, HEAD_DIM ** -0.5)
    decodes, starts = [0, 2, 4], meta.query_start_loc.tolist()
    rows = torch.tensor([starts[b] for b in decodes])
    index = torch.tensor(decodes)
    alone = AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows], query_start_loc=torch.arange(4, dtype=torch.int32),
        seq_lens=meta.seq_lens[index], block_tables=meta.block_tables[index],
        block_size=BLOCK, max_query_len=1, max_seq_len=40, query_lens_list=[1, 1, 1],
        seq_lens_list=[19, 26, 40])
    assert torch.equal(out[rows], quantized.attend(q[rows], k[rows], v[rows], *cache, alone,
                                                   HEAD_DIM ** -0.5))
    ref = _reference(q, cache, meta)
    prompt_rows = torch.tensor([r for r in range(q.shape[0]) if r not in rows.tolist()])
    torch.testing.assert_close(out.float()[prompt_rows], ref[prompt_rows], atol=0.25, rtol=0.25)


def test_the_torch_route_runs_without_the_native_kernel(monkeypatch):
    from tokenmill.kernels import paged_decode as native

    monkeypatch.setattr(native, "store_kv_q8", lambda *a: False)
    monkeypatch.setattr(native, "paged_decode_q8", lambda *a, **k: None)
    fmt = kv_quant.FORMATS["int8"]
    q, k, v, cache, meta = _step(fmt, [1, 1, 1], [9, 22, 14])
    out = quantized.attend(q, k, v, *cache, meta, HEAD_DIM ** -0.5)
    torch.testing.assert_close(out.float(), _reference(q, cache, meta), atol=2e-2, rtol=2e-2)


class _Bf16Only(TorchBackend):
    """A backend that reads only the unquantized cache (as the triton one, for now)."""

    name = "bf16only"
    kv_cache_dtypes = ("auto", "bfloat16")


def test_a_backend_that_cannot_read_the_format_fails_at_start_up(monkeypatch):
    import tokenmill.attention as registry

    monkeypatch.setitem(registry._REGISTRY, "bf16only", f"{__name__}:_Bf16Only")
    quantized.check_kv_cache_dtype("cpu", "int8")
    quantized.check_kv_cache_dtype("torch", "fp8")
    quantized.check_kv_cache_dtype("bf16only", "auto")
    with pytest.raises(ValueError, match=r"--kv-cache-dtype int8 is not supported by the "
                                         r"'bf16only' attention backend.*torch, cpu"):
        quantized.check_kv_cache_dtype("bf16only", "int8")
