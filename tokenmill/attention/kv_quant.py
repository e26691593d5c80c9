"""8-bit KV cache formats (`--kv-cache-dtype int8 | fp8 | fp8_e4m3 | fp8_e5m2`).

Each stored row (one token's K or V for one KV head, `head_dim` values) keeps one fp32
scale = absmax / the format's largest value, computed when the row is stored: a decode
step writes a block one token at a time, so a per-block scale fixed at the first write
would clip later tokens. A pool is (kv_heads, blocks, block_size, head_dim) of the
1-byte dtype, its scales (kv_heads, blocks, block_size) fp32.

This module is the torch reference (quantize on store, dequantize on read); the native
CPU path (tokenmill/kernels/paged_decode.c) reads the bytes in place, and writes them
with the same rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVFormat:
    name: str  # the canonical --kv-cache-dtype value
    dtype: torch.dtype  # the pool's element type (1 byte)
    max_value: float  # the largest magnitude a scaled value may take
    native_code: int  # FMT_* in paged_decode.c
    # worst-case round-trip error of one element, as (relative to |x|, relative to the
    # row's absmax): int8 rounds to a step of absmax/127; fp8 keeps 3 (2) mantissa bits,
    # and its subnormals have a fixed step
    rel_error: float
    abs_error_of_absmax: float


FORMATS = {
    "int8": KVFormat("int8", torch.int8, 127.0, 0, 0.0, 0.5 / 127),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0, 1, 2.0**-4, 2.0**-10 / 448),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0, 2, 2.0**-3,
                         2.0**-17 / 57344),
}
ALIASES = {"fp8": "fp8_e4m3"}  # as vLLM: fp8 means e4m3


def kv_format(kv_cache_dtype: str) -> KVFormat | None:
    """The 8-bit format of a --kv-cache-dtype value; None for auto / bfloat16 (unquantized)."""
    name = ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name in ("auto", "bfloat16", None):
        return None
    if name not in FORMATS:
        raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r}; use auto, bfloat16, "
                         f"{', '.join([*ALIASES, *FORMATS])}")
    return FORMATS[name]


def bytes_per_element(kv_cache_dtype: str, model_dtype: torch.dtype) -> int:
    """What one cached K or V element costs, scales aside (see scale_bytes_per_row)."""
    return 1 if kv_format(kv_cache_dtype) else torch.empty((), dtype=model_dtype).element_size()


SCALE_BYTES = 4  # one fp32 scale per (token, kv head), for K and for V


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim) -> (bytes (..., head_dim) of fmt.dtype, scales (...) fp32)."""
    xf = x.float()
    scale = xf.abs().amax(-1) / fmt.max_value  # (...)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (xf / safe[..., None]).clamp_(-fmt.max_value, fmt.max_value)
    if fmt.dtype == torch.int8:
        return torch.round(y).to(torch.int8), scale
    return y.to(fmt.dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bytes (..., head_dim), scales (...) -> values (..., head_dim) in `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


def store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor,
          fmt: KVFormat) -> None:
    """Quantize k, v (T, kv_heads, head_dim) into the slots (T,) of 8-bit pools and scales."""
    kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        q, s = quantize(x.transpose(0, 1), fmt)  # (kv, T, d), (kv, T)
        # index_copy_ has no fp8 kernels: copy the bytes
        cache.view(torch.uint8).view(kv_heads, -1, head_dim).index_copy_(
            1, slot_mapping, q.view(torch.uint8))
        scales.view(kv_heads, -1).index_copy_(1, slot_mapping, s)
