"""Decode attention that reads a paged bf16 or 8-bit KV cache in place (paged_decode.c).

`paged_decode` returns None when the kernel is not available (no compiler,
TOKENMILL_NATIVE=0) or does not take the inputs (not CPU, not bf16, shapes
outside its limits); callers then run their plain-torch path.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from tokenmill.kernels.build import Library

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_lib = Library("paged_decode", {
    "tm_paged_decode_bf16": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64,
                              _I64, _I64, _I64, _I64, _F32, _PTR, _PTR, _PTR, _PTR, _PTR,
                              _I64, _I64], ctypes.c_int),
    "tm_cascade_decode_bf16": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64,
                                _I64, _I64, _I64, _I64, _F32, _PTR, _PTR, _PTR, _I64, _I64,
                                _I64], ctypes.c_int),
    "tm_cascade_scratch_floats": ([_I64] * 8, _I64),
    "tm_prompt_attend_bf16": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
                               _I64, _I64, _F32, _PTR, _PTR, _I64, _I64], ctypes.c_int),
    "tm_prompt_scratch_floats": ([_I64] * 5, _I64),
    "tm_store_kv_bf16": ([_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64,
                          _I64], ctypes.c_int),
    "tm_paged_decode_q8": ([_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _PTR,
                            _I64, _I64, _I64, _I64, _I64, _I64, _F32, _PTR, _PTR, _PTR, _PTR,
                            _PTR, _I64, _I64], ctypes.c_int),
    "tm_store_kv_q8": ([_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64,
                        _I64, _I64, _I64, _I64], ctypes.c_int),
})
_Q8_DTYPES = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # FMT_* in C


def available() -> bool:
    return _lib.get("tm_paged_decode_bf16") is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, first_block: int, lens: torch.Tensor, max_len: int,
                 scale: float, scratch: torch.Tensor, with_lse: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """One query per sequence over its blocks `tables[b, first_block:]`, `lens[b]` tokens.

    q (B, H, D); k_cache, v_cache (KVH, blocks, block_size, D) bf16; tables (B, *)
    int32; lens (B,) int32, each in 1..max_len; scratch: >= B * H * max_len fp32.
    Returns (out (B, H, D), None, None), normalised, in q's dtype; with `with_lse`,
    fp32 (sum_t exp(s_t - m) v_t, m, l) with the row maximum m and denominator l
    (B, H), for the caller to merge with another part of the keys."""
    fn = _lib.get("tm_paged_decode_bf16")
    if (fn is None or k_cache.dtype != torch.bfloat16 or v_cache.dtype != torch.bfloat16
            or k_cache.device.type != "cpu" or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or tables.dtype != torch.int32
            or lens.dtype != torch.int32 or scratch.dtype != torch.float32):
        return None
    return _decode(fn, q, (k_cache.data_ptr(), v_cache.data_ptr()), k_cache.shape, tables,
                   first_block, lens, max_len, scale, scratch, with_lse)


def cascade_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   tables: torch.Tensor, shared_blocks: int, lens: torch.Tensor, max_len: int,
                   scale: float, workspace: Any) -> torch.Tensor | None:
    """`paged_decode` for a batch whose tables all start with the same `shared_blocks`
    blocks: those are read once for every query of the batch, each sequence's own
    `lens[b]` tokens after them as `paged_decode` reads them, and the two parts merged,
    all in one native call. Returns out (B, H, D), normalised, in q's dtype, or None
    when the kernel is not available or does not take the inputs (tables that differ
    in the shared blocks among them). workspace(numel) -> a float32 scratch tensor."""
    fn, size = _lib.get("tm_cascade_decode_bf16"), _lib.get("tm_cascade_scratch_floats")
    if (fn is None or size is None or k_cache.dtype != torch.bfloat16
            or v_cache.dtype != torch.bfloat16 or k_cache.device.type != "cpu"
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or tables.dtype != torch.int32 or lens.dtype != torch.int32):
        return None
    num_seqs, heads, d = q.shape
    kv_heads, num_blocks, block_size, _ = k_cache.shape
    threads = torch.get_num_threads()
    numel = size(num_seqs, heads, kv_heads, d, block_size, shared_blocks, max_len, threads)
    if numel < 0:
        return None
    scratch = workspace(numel)
    qb = q.to(torch.bfloat16)
    if qb.stride(2) != 1 or qb.stride(1) != d:
        qb = qb.contiguous()
    tables, lens = tables.contiguous(), lens.contiguous()
    bf16_out = q.dtype == torch.bfloat16
    out = torch.empty(num_seqs, heads, d, dtype=q.dtype if bf16_out else torch.float32)
    rc = fn(qb.data_ptr(), qb.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            tables.data_ptr(), tables.stride(0), shared_blocks, lens.data_ptr(), num_seqs,
            heads, kv_heads, num_blocks, block_size, d, scale,
            None if bf16_out else out.data_ptr(), out.data_ptr() if bf16_out else None,
            scratch.data_ptr(), scratch.numel(), max_len, threads)
    if rc != 0:
        return None
    return out if bf16_out else out.to(q.dtype)


def prompt_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  table: torch.Tensor, seq_len: int, scale: float, workspace: Any
                  ) -> torch.Tensor | None:
    """Causal attention of a prompt chunk q (Q, H, D) bf16, the sequence's last Q tokens,
    over its seq_len tokens, all in the cache (table: its blocks, int32), read in place;
    query tiles against their keys with the queries in vector lanes. Returns out
    (Q, H, D) bf16, or None when the kernel is not available or does not take the
    inputs. workspace(numel) -> a float32 scratch tensor."""
    fn, size = _lib.get("tm_prompt_attend_bf16"), _lib.get("tm_prompt_scratch_floats")
    if (fn is None or size is None or q.dtype != torch.bfloat16
            or k_cache.dtype != torch.bfloat16 or v_cache.dtype != torch.bfloat16
            or k_cache.device.type != "cpu" or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or table.dtype != torch.int32):
        return None
    num_q, heads, d = q.shape
    kv_heads, num_blocks, block_size, _ = k_cache.shape
    threads = torch.get_num_threads()
    numel = size(heads, kv_heads, d, seq_len, threads)
    if numel < 0 or table.numel() * block_size < seq_len:
        return None
    scratch = workspace(numel)
    qb = q if q.stride(2) == 1 and q.stride(1) == d else q.contiguous()
    table = table.contiguous()
    out = torch.empty(num_q, heads, d, dtype=torch.bfloat16)
    rc = fn(qb.data_ptr(), qb.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            table.data_ptr(), num_q, seq_len, heads, kv_heads, num_blocks, block_size, d,
            scale, out.data_ptr(), scratch.data_ptr(), scratch.numel(), threads)
    return out if rc == 0 else None


def _decode(fn: Any, q: torch.Tensor, pools: tuple, pool_shape: torch.Size,
            tables: torch.Tensor, first_block: int, lens: torch.Tensor, max_len: int,
            scale: float, scratch: torch.Tensor, with_lse: bool
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """Both decode kernels' call: `pools` the arguments that name the K/V pools (bf16:
    the two pools; 8-bit: the pools, their scales and the format code), the rest the
    same for both."""
    num_seqs, heads, d = q.shape
    kv_heads, num_blocks, block_size, _ = pool_shape
    qb = q.to(torch.bfloat16)
    if qb.stride(2) != 1 or qb.stride(1) != d:  # rows may be apart (a view of QKV)
        qb = qb.contiguous()
    tables, lens = tables.contiguous(), lens.contiguous()
    bf16_out = not with_lse and q.dtype == torch.bfloat16
    out = torch.empty(num_seqs, heads, d, dtype=q.dtype if bf16_out else torch.float32)
    m = torch.empty(num_seqs, heads, dtype=torch.float32) if with_lse else None
    l_ = torch.empty(num_seqs, heads, dtype=torch.float32) if with_lse else None
    rc = fn(qb.data_ptr(), qb.stride(0), *pools,
            tables.data_ptr(), tables.stride(0), first_block, lens.data_ptr(), num_seqs, heads,
            kv_heads, num_blocks, block_size, d, scale,
            None if bf16_out else out.data_ptr(), out.data_ptr() if bf16_out else None,
            m.data_ptr() if m is not None else None, l_.data_ptr() if l_ is not None else None,
            scratch.data_ptr(), max_len, torch.get_num_threads())
    if rc != 0:
        return None
    return (out if bf16_out or with_lse else out.to(q.dtype)), m, l_


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> bool:
    """k, v (T, kv_heads, D) into the slots (T,) int64 of bf16 pools; False (nothing
    written) when the kernel does not take the inputs or a slot is out of range."""
    if (k_cache.dtype != torch.bfloat16 or k_cache.device.type != "cpu"
            or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or v_cache.dtype != torch.bfloat16 or slots.dtype != torch.int64
            or not slots.is_contiguous() or slots.device.type != "cpu"):
        return False  # checked before the kernel is looked up: no build on a GPU machine
    fn = _lib.get("tm_store_kv_bf16")
    if fn is None:
        return False
    tokens, kv_heads, d = k.shape
    if k.stride(2) != 1 or k.stride(1) != d or v.stride(2) != 1 or v.stride(1) != d:
        return False
    _, num_blocks, block_size, _ = k_cache.shape
    # a slot outside the pool writes nothing and returns -1: the torch path then raises
    return fn(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(),
              v_cache.data_ptr(), slots.data_ptr(), tokens, kv_heads, num_blocks, block_size,
              d) == 0


def _q8_ok(cache: torch.Tensor, scales: torch.Tensor) -> bool:
    return (cache.dtype in _Q8_DTYPES and cache.device.type == "cpu" and cache.is_contiguous()
            and scales.dtype == torch.float32 and scales.is_contiguous()
            and scales.shape == cache.shape[:3])


def paged_decode_q8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    k_scale: torch.Tensor, v_scale: torch.Tensor, tables: torch.Tensor,
                    first_block: int, lens: torch.Tensor, max_len: int, scale: float,
                    scratch: torch.Tensor, with_lse: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """`paged_decode` over 8-bit pools (KVH, blocks, block_size, D) of int8 or fp8
    (e4m3fn / e5m2) with their fp32 scales (KVH, blocks, block_size), dequantized in
    registers. None when the kernel is not available or does not take the inputs."""
    if not (_q8_ok(k_cache, k_scale) and _q8_ok(v_cache, v_scale)
            and k_cache.dtype == v_cache.dtype and tables.dtype == torch.int32
            and lens.dtype == torch.int32 and scratch.dtype == torch.float32):
        return None
    fn = _lib.get("tm_paged_decode_q8")
    if fn is None:
        return None
    pools = (k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
             _Q8_DTYPES[k_cache.dtype])
    return _decode(fn, q, pools, k_cache.shape, tables, first_block, lens, max_len, scale,
                   scratch, with_lse)


def store_kv_q8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                k_scale: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor) -> bool:
    """Quantize k, v (T, kv_heads, D) bf16 into the slots (T,) int64 of 8-bit pools and their
    scales, one scale per (token, kv head); False (nothing written) when the kernel does not
    take the inputs or a slot is out of range."""
    if not (_q8_ok(k_cache, k_scale) and _q8_ok(v_cache, v_scale)
            and k_cache.dtype == v_cache.dtype and k.dtype == torch.bfloat16
            and v.dtype == torch.bfloat16 and slots.dtype == torch.int64
            and slots.is_contiguous() and slots.device.type == "cpu"):
        return False
    fn = _lib.get("tm_store_kv_q8")
    if fn is None:
        return False
    tokens, kv_heads, d = k.shape
    if k.stride(2) != 1 or k.stride(1) != d or v.stride(2) != 1 or v.stride(1) != d:
        return False
    _, num_blocks, block_size, _ = k_cache.shape
    return fn(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(),
              v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(), slots.data_ptr(),
              tokens, kv_heads, num_blocks, block_size, d, _Q8_DTYPES[k_cache.dtype],
              torch.get_num_threads()) == 0
