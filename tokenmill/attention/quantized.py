"""Attention over an 8-bit KV cache (--kv-cache-dtype int8 | fp8*): store and attend.

The pools hold one byte per element and one fp32 scale per (token, kv head)
(attention/kv_quant.py). On the CPU, this step's K/V are quantized by the native store
(tokenmill/kernels/paged_decode.c) and decode-only steps are read in place by the
native 8-bit kernel: bytes and scales widened in registers, no dequantized copy of the
cache. Other steps (prompt chunks, mixed batches) and other devices take the reference
route: the blocks this step reads are dequantized into a compact scratch pool, with the
block tables renumbered into it, and the bf16 paths (attention/cpu.py on a CPU, the
torch reference elsewhere) run on that.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenmill.attention import kv_quant
from tokenmill.attention.kv_quant import KVFormat
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.kernels import paged_decode as native

# attention backends (tokenmill/attention/__init__.py's registry) -> the --kv-cache-dtype
# values each reads; a backend missing here reads only the unquantized cache
SUPPORTED_KV_CACHE_DTYPES = {
    "torch": ("auto", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"),
    "cpu": ("auto", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"),
}


def attention_backend_name(device: torch.device) -> str:
    """The backend models/attention.py runs on `device` today (TOKENMILL_ATTENTION); the
    seam's runner will name its chosen backend instead."""
    from tokenmill.models import attention

    return "cpu" if device.type == "cpu" and attention.BACKEND != "reference" else "torch"


def check_backend_supports(backend: str, kv_cache_dtype: str) -> None:
    """A clear start-up error when `backend` cannot read a `kv_cache_dtype` cache."""
    supported = SUPPORTED_KV_CACHE_DTYPES.get(backend, ("auto", "bfloat16"))
    if kv_cache_dtype not in supported:
        others = [b for b, d in SUPPORTED_KV_CACHE_DTYPES.items() if kv_cache_dtype in d]
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} is not supported by the "
                         f"{backend!r} attention backend (it reads {', '.join(supported)}); "
                         f"backends that read it: {', '.join(others) or 'none'}")


@dataclass
class QuantizedCache:
    """One layer's 8-bit K/V: pools (kv_heads, blocks, block_size, head_dim) of fmt.dtype
    and scales (kv_heads, blocks, block_size) fp32."""

    fmt: KVFormat
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @classmethod
    def allocate(cls, fmt: KVFormat, shape: tuple[int, int, int, int],
                 device: torch.device) -> QuantizedCache:
        # bytes: empty (pages are touched as blocks fill; the runner zeroes each block on
        # first use); scales: zeros, 1/head_dim of the bytes
        return cls(fmt, torch.empty(shape, dtype=fmt.dtype, device=device),
                   torch.empty(shape, dtype=fmt.dtype, device=device),
                   torch.zeros(shape[:3], device=device), torch.zeros(shape[:3], device=device))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k, self.v, self.k_scale, self.v_scale))

    def zero_blocks(self, idx: torch.Tensor) -> None:
        for pool in (self.k, self.v):
            pool.view(torch.uint8).index_fill_(1, idx, 0)  # fp8 has no index_fill_ kernel
        for scales in (self.k_scale, self.v_scale):
            scales.index_fill_(1, idx, 0.0)

    def store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize this step's k, v (T, kv_heads, head_dim) into their slots."""
        if native.store_kv_q8(k, v, self.k, self.v, self.k_scale, self.v_scale, slot_mapping):
            return
        kv_quant.store(k, v, self.k, self.v, self.k_scale, self.v_scale, slot_mapping, self.fmt)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: QuantizedCache,
           meta: AttentionMetadata, scale: float, reference: bool = False) -> torch.Tensor:
    """q (T, heads, d); k, v this step's (T, kv_heads, d), already stored. -> (T, heads, d).
    reference: the torch path (dequantize, then torch_ref) whatever the device."""
    cpu = q.device.type == "cpu" and not reference
    if meta.is_decode_only and cpu and q.dtype == torch.bfloat16:
        out = _decode_native(q, cache, meta, scale)
        if out is not None:
            return out
    compact = meta.derived.get("q8_compact")
    if compact is None:  # the same for every layer of the step
        compact = meta.derived["q8_compact"] = _Compact(meta)
    k_deq = kv_quant.dequantize(cache.k.index_select(1, compact.blocks),
                                cache.k_scale.index_select(1, compact.blocks), q.dtype)
    v_deq = kv_quant.dequantize(cache.v.index_select(1, compact.blocks),
                                cache.v_scale.index_select(1, compact.blocks), q.dtype)
    if cpu:
        from tokenmill.attention.cpu import paged_attention_fast

        return paged_attention_fast(q, k, v, k_deq, v_deq, compact.meta, scale)
    from tokenmill.attention.torch_ref import paged_attention_reference

    return paged_attention_reference(q, k_deq, v_deq, compact.meta, scale)


def _decode_native(q: torch.Tensor, cache: QuantizedCache, meta: AttentionMetadata,
                   scale: float) -> torch.Tensor | None:
    plan = meta.derived.get("q8_decode")
    if plan is None:
        plan = meta.derived["q8_decode"] = (meta.block_tables.to(torch.int32).contiguous(),
                                            meta.seq_lens.to(torch.int32).contiguous())
    tables, lens = plan
    num_seqs, heads, _ = q.shape
    scratch = meta.derived.get("q8_scratch")
    if scratch is None:
        scratch = meta.derived["q8_scratch"] = torch.empty(num_seqs * heads * meta.max_seq_len)
    result = native.paged_decode_q8(q, cache.k, cache.v, cache.k_scale, cache.v_scale, tables,
                                    0, lens, meta.max_seq_len, scale, scratch)
    return None if result is None else result[0]


class _Compact:
    """The blocks a step reads, and its metadata with the tables renumbered into them."""

    def __init__(self, meta: AttentionMetadata) -> None:
        device = meta.block_tables.device
        width = -(-meta.max_seq_len // meta.block_size)
        tables = meta.block_tables[:, :width].long()
        self.blocks, renumbered = torch.unique(tables, return_inverse=True)
        slots = meta.slot_mapping
        block_of = torch.full((int(self.blocks.max()) + 1,), -1, dtype=torch.int64,
                              device=device)
        block_of[self.blocks] = torch.arange(self.blocks.numel(), device=device)
        self.meta = replace(
            meta, block_tables=renumbered.to(torch.int32),
            slot_mapping=block_of[slots // meta.block_size] * meta.block_size
            + slots % meta.block_size, plan=None, derived={})
