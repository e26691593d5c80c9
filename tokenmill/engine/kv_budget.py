"""How many KV blocks to allocate: an explicit count, a byte budget, or a
sensible share of free memory (RAM on CPU, GPU memory on CUDA)."""

from __future__ import annotations

import os

import torch

from tokenmill.config import CacheConfig, ModelConfig

CPU_DEFAULT_SHARE = 0.15  # of available RAM
CPU_DEFAULT_CAP_BYTES = 2 * 2**30
CUDA_DEFAULT_SHARE = 0.85  # of free GPU memory after the weights are loaded


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V, every layer, one block of tokens."""
    elem = torch.empty((), dtype=dtype).element_size()
    return (2 * config.num_hidden_layers * block_size * config.num_key_value_heads
            * config.head_dim * elem)


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def choose_num_blocks(config: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                      device: torch.device, max_model_len: int, max_num_seqs: int) -> int:
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = kv_cache_bytes_per_block(config, cache.block_size, dtype)
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if cache.memory_utilization is not None:  # vLLM: of the whole GPU, weights included
            budget = int(free - total * (1.0 - cache.memory_utilization))
        else:
            budget = int(free * CUDA_DEFAULT_SHARE)
    elif cache.memory_utilization is not None:
        budget = int(available_ram_bytes() * cache.memory_utilization)
    else:
        # never more than every sequence at full length could use
        need = max_num_seqs * max_model_len * per_block // cache.block_size
        budget = min(int(available_ram_bytes() * CPU_DEFAULT_SHARE), CPU_DEFAULT_CAP_BYTES,
                     need + per_block)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) is smaller than one block "
            f"({per_block} bytes); raise --kv-cache-memory or --gpu-memory-utilization")
    return num_blocks
