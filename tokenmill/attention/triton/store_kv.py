"""The KV store: this step's K and V rows into the paged pool at slot_mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.spec import KernelSpec

# tokens per program: a (STORE_BLOCK_T, head_dim) tile of one KV head
STORE_BLOCK_T = 32


@triton.jit(do_not_specialize=["num_tokens"])
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
                    stride_kt, stride_kh, stride_vt, stride_vh, stride_slot, stride_head,
                    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    # grid: (cdiv(tokens, BLOCK_T), kv_heads)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    in_batch = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=in_batch, other=-1)  # int64; < 0: padding, not stored
    keep = (slot >= 0)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    src_t = t.to(tl.int64)[:, None]
    k = tl.load(k_ptr + src_t * stride_kt + h * stride_kh + d, mask=in_batch[:, None])
    v = tl.load(v_ptr + src_t * stride_vt + h * stride_vh + d, mask=in_batch[:, None])
    dst = slot[:, None] * stride_slot + h * stride_head + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=keep)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=keep)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: (T, kv_heads, head_dim), last dim contiguous; caches
    (num_blocks, block_size, kv_heads, head_dim) contiguous; slot_mapping (T,) int64."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    store_kv_kernel[(triton.cdiv(num_tokens, STORE_BLOCK_T), num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_T=STORE_BLOCK_T)


def compile_specs(dtype: str, head_dim: int) -> list[KernelSpec]:
    """The variant the backend launches for a KV cache of `dtype` ("bf16", "fp16",
    "fp32") and head_dim (default launch options)."""
    ptr = f"*{dtype}"
    sig = {"k_ptr": ptr, "v_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr,
           "slot_ptr": "*i64", "num_tokens": "i32", **dict.fromkeys(
               ["stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_slot",
                "stride_head"], "i32"), "HEAD_DIM": "constexpr", "BLOCK_T": "constexpr"}
    return [KernelSpec("store_kv", store_kv_kernel, sig,
                       {"HEAD_DIM": head_dim, "BLOCK_T": STORE_BLOCK_T})]
