"""Rotary and the KV store in one kernel: a decode step's query and key heads rotated
in place, the rotated keys and the values written into the paged pool at slot_mapping.

Unfused, a layer launches the rotary kernel (triton_layer_ops.rotary_, q and k heads
together) and then the store (store_kv.py), which reads the rotated keys back: at batch
1 both are a few microseconds of launch each, ~32 layers a step (issue 63: "rotary
fused with the KV store"). This one does both per token, in the same fp32 arithmetic
and the same roundings (the rotated value to the activations' dtype, then to the
pool's), so the two forms give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.spec import KernelSpec
from tokenmill.kernels.triton_layer_ops import _warps, rotate_in_place


@triton.jit
def rotary_store_kernel(qk_ptr, v_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, k_cache_ptr,
                        v_cache_ptr, stride_t, stride_h, stride_vt, stride_vh, stride_slot,
                        stride_head, num_heads, num_kv_heads, HALF: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr):
    # grid: (tokens,); the token's num_heads query and num_kv_heads key heads of qk
    # rotated in place (x * cos + roll(x, half) * sin in fp32, as triton_layer_ops'
    # rotary), then its rotated keys and its values into the pools at its slot
    # (slot < 0: a padding row, nothing stored)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < num_heads + num_kv_heads
    new_lo, new_hi = rotate_in_place(qk_ptr + t * stride_t + h * stride_h + d, mask, pos,
                                     cos_ptr, sin_ptr, d, HALF)
    # the key heads (rows num_heads.. of the tile) into the K pool
    # (the slot's test as a tile: a scalar bool is not a mask the interpreter takes)
    is_key = mask & (h >= num_heads) & ((tl.zeros([BLOCK_H, 1], tl.int64) + slot) >= 0)
    k_dst = k_cache_ptr + slot * stride_slot + (h - num_heads) * stride_head + d
    tl.store(k_dst, new_lo.to(k_cache_ptr.dtype.element_ty), mask=is_key)
    tl.store(k_dst + HALF, new_hi.to(k_cache_ptr.dtype.element_ty), mask=is_key)
    # the values as they are into the V pool
    vh = tl.arange(0, BLOCK_KV)[:, None]
    dv = tl.arange(0, 2 * HALF)[None, :]
    keep = (vh < num_kv_heads) & ((tl.zeros([BLOCK_KV, 1], tl.int64) + slot) >= 0)
    val = tl.load(v_ptr + t * stride_vt + vh * stride_vh + dv, mask=keep)
    tl.store(v_cache_ptr + slot * stride_slot + vh * stride_head + dv,
             val.to(v_cache_ptr.dtype.element_ty), mask=keep)


def rotary_store_kv(qk: torch.Tensor, v: torch.Tensor, num_heads: int,
                    positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> bool:
    """qk (T, num_heads + kv_heads, D): query then key heads, rotated in place at
    `positions` (T,) int64 with fp32 tables (max_pos, D) laid out as
    RotaryEmbedding's; the rotated keys and v (T, kv_heads, D) into the caches
    (num_blocks, block_size, kv_heads, D) at slot_mapping (T,) int64, slot < 0 skipped.
    False (nothing touched) where the kernel does not take the tensors."""
    tokens, heads, d = qk.shape
    kv_heads = heads - num_heads
    if (d % 2 or d & (d - 1) or kv_heads < 1 or qk.stride(2) != 1 or v.stride(2) != 1
            or tuple(v.shape) != (tokens, kv_heads, d)
            or positions.dtype != torch.int64 or positions.dim() != 1
            or positions.stride(0) != 1 or slot_mapping.dtype != torch.int64
            or slot_mapping.dim() != 1 or slot_mapping.stride(0) != 1
            or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.shape[1] != d
            or k_cache.shape != v_cache.shape or k_cache.dim() != 4
            or tuple(k_cache.shape[2:]) != (kv_heads, d) or not k_cache.is_contiguous()
            or not v_cache.is_contiguous()
            or not (qk.device == v.device == positions.device == cos.device == sin.device
                    == k_cache.device == slot_mapping.device)):
        return False
    if tokens:
        block_h = triton.next_power_of_2(heads)
        rotary_store_kernel[(tokens,)](
            qk, v, positions, slot_mapping, cos, sin, k_cache, v_cache, qk.stride(0),
            qk.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
            num_heads, kv_heads, HALF=d // 2, BLOCK_H=block_h,
            BLOCK_KV=triton.next_power_of_2(kv_heads), num_warps=_warps(block_h * d))
    return True


def compile_specs(dtype: str, head_dim: int, heads: int = 32, kv_heads: int = 8
                  ) -> list[KernelSpec]:
    """The variant a CUDA step launches for activations and pool of `dtype` at head_dim
    (Llama-3-8B's 32 query and 8 key heads by default)."""
    ptr = f"*{dtype}"
    sig = {"qk_ptr": ptr, "v_ptr": ptr, "pos_ptr": "*i64", "slot_ptr": "*i64",
           "cos_ptr": "*fp32", "sin_ptr": "*fp32", "k_cache_ptr": ptr, "v_cache_ptr": ptr,
           **dict.fromkeys(["stride_t", "stride_h", "stride_vt", "stride_vh", "stride_slot",
                            "stride_head", "num_heads", "num_kv_heads"], "i32"),
           "HALF": "constexpr", "BLOCK_H": "constexpr", "BLOCK_KV": "constexpr"}
    block_h = triton.next_power_of_2(heads + kv_heads)
    return [KernelSpec("rotary_store", rotary_store_kernel, sig,
                       {"HALF": head_dim // 2, "BLOCK_H": block_h,
                        "BLOCK_KV": triton.next_power_of_2(kv_heads)},
                       {"num_warps": _warps(block_h * head_dim)})]
