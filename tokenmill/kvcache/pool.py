"""The KV pool: every layer's K and V tensors, in the attention backend's layout.

The one place that allocates KV-cache memory (the block manager only counts
blocks; this holds them). Pages are touched only as blocks fill, so RSS tracks
use. A backend that reads whole blocks and masks afterwards
(`needs_zeroed_blocks`) must never see what fresh memory held, since a zero
weight on a NaN is still NaN: on the CPU the pool is anonymous mmap pages, which
read as zeros until written (the kernel zeroes each as it is first touched); on
another device each block is zeroed the first time a step uses it.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Iterable

import torch

from tokenmill.attention.base import AttentionBackend
from tokenmill.attention.kv_quant import KVFormat
from tokenmill.attention.quantized import QuantizedPool


class KVPool:
    def __init__(self, backend: AttentionBackend, num_layers: int, num_blocks: int,
                 block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, zeroed: bool = False,
                 kv_format: KVFormat | None = None) -> None:
        self.backend = backend
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        shape = backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        alloc, zeroed = allocator(device, zeroed)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (alloc(shape, dtype=dtype, device=device), alloc(shape, dtype=dtype, device=device))
            for _ in range(num_layers)] if kv_format is None else [
            # --kv-cache-dtype int8 / fp8: bytes and their per-(token, head) scales
            (QuantizedPool.allocate(kv_format, shape, device, alloc),  # type: ignore[misc]
             QuantizedPool.allocate(kv_format, shape, device, alloc))
            for _ in range(num_layers)]
        # fresh[b]: block b was never zeroed; None when the backend does not care.
        # The model runner reads it while it lays out a step (ModelRunner.prepare).
        self.fresh: bytearray | None = None
        if backend.needs_zeroed_blocks and not zeroed:
            self.fresh = bytearray(b"\x01") * num_blocks
            self.zero_blocks([0])  # now: block 0 pads block tables
        backend.bind_pool(self.kv_caches)

    @classmethod
    def for_model(cls, model: torch.nn.Module, backend: AttentionBackend, num_blocks: int,
                  block_size: int, dtype: torch.dtype, device: torch.device,
                  zeroed: bool = False) -> KVPool:
        """A pool for every attention layer of `model`, attached to them."""
        layers = list(model.attention_layers())
        first = layers[0]
        pool = cls(backend, len(layers), num_blocks, block_size, first.num_kv_heads,
                   first.head_dim, dtype, device, zeroed)
        pool.attach(layers)
        return pool

    def attach(self, layers: Iterable[torch.nn.Module]) -> None:
        """Give each attention layer its backend and its (K, V), in order."""
        for layer, (k, v) in zip(layers, self.kv_caches, strict=True):
            layer.backend, layer.k_cache, layer.v_cache = self.backend, k, v

    def zero_blocks(self, block_ids: list[int]) -> None:
        dim = self.backend.block_dim
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for k, v in self.kv_caches:
            k.index_fill_(dim, idx, 0)
            v.index_fill_(dim, idx, 0)
        if self.fresh is not None:
            for b in block_ids:
                self.fresh[b] = 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv_caches)


def allocator(device: torch.device, zeroed: bool) -> tuple[Callable[..., torch.Tensor], bool]:
    """How the pool allocates on `device` (alloc(shape, dtype=, device=)), and whether
    what it allocates reads as zeros."""
    if device.type == "cpu":
        return zero_pages, True
    return (torch.zeros if zeroed else torch.empty), zeroed


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A CPU tensor of zeros that costs nothing until written: anonymous mmap pages
    (page-aligned), each zeroed by the kernel as it is first touched. The tensor holds
    the mapping; it is unmapped when the tensor is freed."""
    count = math.prod(shape)
    pages = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)
