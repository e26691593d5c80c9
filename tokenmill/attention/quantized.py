"""Attention over an 8-bit KV cache (--kv-cache-dtype int8 | fp8 | fp8_e4m3 | fp8_e5m2).

A layer's K (and V) is a `QuantizedPool`: one byte per element in the backend's
head-major layout (kv_heads, num_blocks, block_size, head_dim), and one fp32 scale per
(token, kv head), (kv_heads, num_blocks, block_size), allocated next to it by the KV
pool (tokenmill/kvcache/pool.py); attention/kv_quant.py defines the formats.

`QuantizedKVBackend` wraps the backend the runner chose (`torch` or `cpu`; a backend
declares the formats it reads in `kv_cache_dtypes`). On the CPU, this step's K/V are
quantized by the native store (tokenmill/kernels/paged_decode.c) and decode-only steps
are read in place by the native 8-bit kernel: bytes and scales widened in registers, no
dequantized copy of the cache; so are the single-token rows of a mixed step (`_Split`).
Prompt chunks, the `torch` backend and other devices dequantize the blocks they read
into a compact scratch pool, with the block tables renumbered into it, and run the
wrapped backend's bf16 path on that.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from tokenmill.attention import kv_quant
from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.kv_quant import KVFormat
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.kernels import paged_decode as native

ALL_KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


def check_kv_cache_dtype(backend_name: str, kv_cache_dtype: str) -> None:
    """A clear start-up error when the backend `backend_name` cannot read the cache."""
    from tokenmill.attention import _REGISTRY, _load

    supported = _load(backend_name).kv_cache_dtypes
    if kv_cache_dtype not in supported:
        others = [name for name in _REGISTRY
                  if kv_cache_dtype in _try_dtypes(name)]
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} is not supported by the "
                         f"{backend_name!r} attention backend (it reads "
                         f"{', '.join(supported)}); backends that read it: "
                         f"{', '.join(others) or 'none'}")


def _try_dtypes(name: str) -> tuple[str, ...]:
    from tokenmill.attention import BackendUnavailable, _load

    try:
        return _load(name).kv_cache_dtypes
    except BackendUnavailable:
        return ()


@dataclass
class QuantizedPool:
    """One layer's K (or V): bytes (kv_heads, blocks, block_size, head_dim) of fmt.dtype
    and their scales (kv_heads, blocks, block_size) fp32."""

    fmt: KVFormat
    data: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def allocate(cls, fmt: KVFormat, shape: tuple[int, ...], device: torch.device,
                 alloc: Callable[..., torch.Tensor] = torch.empty) -> QuantizedPool:
        """alloc(shape, dtype=, device=) for the bytes (torch.empty, torch.zeros or the
        pool's zero pages)."""
        # scales: zeros always (1/head_dim of the bytes), so a never-written slot reads 0
        return cls(fmt, alloc(shape, dtype=fmt.dtype, device=device),
                   torch.zeros(shape[:3], device=device))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def index_fill_(self, dim: int, idx: torch.Tensor, value: float) -> None:
        """Zero whole blocks, as the pool does to a plain tensor (fp8 has no fill kernel)."""
        self.data.view(torch.uint8).index_fill_(dim, idx, 0)
        self.scale.index_fill_(dim, idx, 0.0)


class QuantizedKVBackend(AttentionBackend):
    """The chosen backend, reading and writing 8-bit pools of `fmt`."""

    block_dim: ClassVar[int] = 1
    # the CPU decode reads whole blocks and masks afterwards, as the bf16 one
    needs_zeroed_blocks: ClassVar[bool] = True

    def __init__(self, inner: AttentionBackend, fmt: KVFormat) -> None:
        super().__init__(inner.device, fmt.dtype)
        if inner.block_dim != 1:
            raise ValueError(f"the {inner.name!r} backend's KV layout is not head-major")
        self.inner, self.fmt = inner, fmt
        self.name = inner.name  # type: ignore[misc]  (the chosen backend's, for logs)
        self.reference = inner.name == "torch"

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        return self.inner.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def plan(self, meta: AttentionMetadata) -> _Plan:
        return _Plan(meta)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: QuantizedPool,
                 v_cache: QuantizedPool, meta: AttentionMetadata) -> None:
        """Quantize this step's k, v (T, kv_heads, head_dim) into their slots."""
        if native.store_kv_q8(k, v, k_cache.data, v_cache.data, k_cache.scale, v_cache.scale,
                              meta.slot_mapping):
            return
        kv_quant.store(k, v, k_cache.data, v_cache.data, k_cache.scale, v_cache.scale,
                       meta.slot_mapping, self.fmt)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: QuantizedPool,
                v_cache: QuantizedPool, meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        if sliding_window is not None:  # a local layer: its blocks dequantized, then masked
            plan = meta.plan if isinstance(meta.plan, _Plan) else _Plan(meta)
            return _dequantized(q, k, v, k_cache, v_cache, plan.compact(), scale, False,
                                sliding_window)
        return attend(q, k, v, k_cache, v_cache, meta, scale, reference=self.reference)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: QuantizedPool,
           v_cache: QuantizedPool, meta: AttentionMetadata, scale: float,
           reference: bool = False) -> torch.Tensor:
    """q (T, heads, d); k, v this step's (T, kv_heads, d), already stored. -> (T, heads, d).
    reference: the torch path (dequantize, then torch_ref) whatever the device."""
    cpu = q.device.type == "cpu" and not reference
    plan = meta.plan
    if not isinstance(plan, _Plan):  # a caller without a model runner: plan here, once
        plan = meta.plan = _Plan(meta)
    if meta.is_decode_only and cpu and q.dtype == torch.bfloat16:
        out = _decode_native(q, k_cache, v_cache, plan, scale)
        if out is not None:
            return out
    split = plan.split() if cpu and q.dtype == torch.bfloat16 else None
    if split is not None:  # a mixed step: its decode rows read in place, as decode steps do
        rows = split.decode_rows
        tables, lens, scratch = split.decode.decode(q.shape[1])
        part = native.paged_decode_q8(q.index_select(0, rows), k_cache.data, v_cache.data,
                                      k_cache.scale, v_cache.scale, tables, 0, lens,
                                      split.decode.meta.max_seq_len, scale, scratch)
        if part is not None:
            out = torch.empty_like(q)
            out[rows] = part[0]
            rest = split.prompt_rows
            out[rest] = _dequantized(q[rest], k[rest], v[rest], k_cache, v_cache,
                                     split.prompt.compact(), scale, cpu)
            return out
    return _dequantized(q, k, v, k_cache, v_cache, plan.compact(), scale, cpu)


def _dequantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: QuantizedPool,
                 v_cache: QuantizedPool, compact: _Compact, scale: float,
                 cpu: bool, sliding_window: int | None = None) -> torch.Tensor:
    """The step's attention over a bf16 copy of just the blocks it reads (`compact`)."""
    blocks = compact.blocks
    k_deq = kv_quant.dequantize(k_cache.data.index_select(1, blocks),
                                k_cache.scale.index_select(1, blocks), q.dtype)
    v_deq = kv_quant.dequantize(v_cache.data.index_select(1, blocks),
                                v_cache.scale.index_select(1, blocks), q.dtype)
    sub = replace(compact.meta, plan=None)  # the bf16 paths plan per layer here
    if sliding_window is not None:
        from tokenmill.attention.window import windowed_paged_attention

        return windowed_paged_attention(q, k_deq, v_deq, sub, scale, sliding_window)
    if cpu:
        from tokenmill.attention.cpu import paged_attention_fast

        return paged_attention_fast(q, k, v, k_deq, v_deq, sub, scale)
    from tokenmill.attention.torch_ref import paged_attention_reference

    return paged_attention_reference(q, k_deq, v_deq, sub, scale)


def _decode_native(q: torch.Tensor, k_cache: QuantizedPool, v_cache: QuantizedPool,
                   plan: _Plan, scale: float) -> torch.Tensor | None:
    tables, lens, scratch = plan.decode(q.shape[1])
    result = native.paged_decode_q8(q, k_cache.data, v_cache.data, k_cache.scale,
                                    v_cache.scale, tables, 0, lens, plan.meta.max_seq_len,
                                    scale, scratch)
    return None if result is None else result[0]


class _Plan:
    """What every layer of a step shares, derived at most once per step."""

    def __init__(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        self._decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._compact: _Compact | None = None
        self._split: _Split | None | bool = False  # False: not derived yet

    def split(self) -> _Split | None:
        """A step with both single-token rows and longer ones (a prompt chunk beside
        decodes), split; None for any other step."""
        if self._split is False:
            lens = self.meta.query_lens_list
            ones = [b for b, n in enumerate(lens) if n == 1]
            self._split = _Split(self.meta, ones) if 0 < len(ones) < len(lens) else None
        return self._split

    def decode(self, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block tables and lengths as the native kernel takes them, and its scratch."""
        if self._decode is None:
            m = self.meta
            self._decode = (m.block_tables.to(torch.int32).contiguous(),
                            m.seq_lens.to(torch.int32).contiguous(),
                            torch.empty(m.num_seqs * heads * m.max_seq_len))
        return self._decode

    def compact(self) -> _Compact:
        if self._compact is None:
            self._compact = _Compact(self.meta)
        return self._compact


class _Split:
    """A mixed step's decode rows (one query token each: the 8-bit kernel reads their
    blocks in place) and its other sequences (a bf16 copy of only their blocks): the
    decodes' contexts are most of such a step's blocks, and dequantizing them every layer
    made W1 1.28x slower with an int8 cache than with bf16."""

    def __init__(self, meta: AttentionMetadata, decodes: list[int]) -> None:
        device = meta.slot_mapping.device
        starts = meta.query_start_loc.tolist()
        single = set(decodes)
        others = [b for b in range(meta.num_seqs) if b not in single]
        self.decode_rows = torch.tensor([starts[b] for b in decodes], device=device)
        self.prompt_rows = torch.cat([torch.arange(starts[b], starts[b + 1], device=device)
                                      for b in others])
        self.decode = _Plan(_subset(meta, decodes, self.decode_rows))
        self.prompt = _Plan(_subset(meta, others, self.prompt_rows))


def _subset(meta: AttentionMetadata, seqs: list[int], rows: torch.Tensor
            ) -> AttentionMetadata:
    """The metadata of sequences `seqs` of `meta` alone, whose tokens are `rows`."""
    index = torch.tensor(seqs, device=meta.seq_lens.device)
    query_lens = [meta.query_lens_list[b] for b in seqs]
    seq_lens = [meta.seq_lens_list[b] for b in seqs]
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32,
                          device=meta.query_start_loc.device)
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping.index_select(0, rows), query_start_loc=starts,
        seq_lens=meta.seq_lens.index_select(0, index),
        block_tables=meta.block_tables.index_select(0, index), block_size=meta.block_size,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_list=query_lens, seq_lens_list=seq_lens)


class _Compact:
    """The blocks a step reads, and its metadata with the tables renumbered into them."""

    def __init__(self, meta: AttentionMetadata) -> None:
        device = meta.block_tables.device
        width = -(-meta.max_seq_len // meta.block_size)
        tables = meta.block_tables[:, :width].long()
        self.blocks, renumbered = torch.unique(tables, return_inverse=True)
        block_of = torch.full((int(self.blocks.max()) + 1,), -1, dtype=torch.int64,
                              device=device)
        block_of[self.blocks] = torch.arange(self.blocks.numel(), device=device)
        slots = meta.slot_mapping
        self.meta = replace(
            meta, block_tables=renumbered.to(torch.int32),
            slot_mapping=block_of[slots // meta.block_size] * meta.block_size
            + slots % meta.block_size, plan=None)
