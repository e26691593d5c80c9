"""How many KV blocks to allocate: an explicit count, a byte budget, or a
sensible share of free memory (RAM on CPU, GPU memory on CUDA)."""

from __future__ import annotations

import os

import torch

from tokenmill.attention.kv_quant import SCALE_BYTES, kv_format
from tokenmill.config import CacheConfig, ModelConfig

CPU_DEFAULT_SHARE = 0.15  # of available RAM
CPU_DEFAULT_CAP_BYTES = 2 * 2**30
CUDA_DEFAULT_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default


class KVBudgetError(ValueError):
    """The device cannot hold the weights, the activations and at least one KV block."""


def cuda_kv_budget_bytes(total: int, weights: int, peak_activation: int, graph_pool: int,
                         utilization: float) -> int:
    """vLLM's arithmetic: the KV cache gets utilization x total device memory, less
    the weights, the peak activation memory of one forward at
    max_num_batched_tokens, and the CUDA-graph memory pool. All in bytes."""
    if not 0.0 < utilization <= 1.0:
        raise KVBudgetError(f"gpu memory utilization must be in (0, 1], got {utilization}")
    allowed = int(total * utilization)
    if weights > allowed:
        raise KVBudgetError(
            f"the weights alone ({weights / 2**30:.2f} GiB) do not fit in {utilization:.0%} "
            f"of the device's {total / 2**30:.2f} GiB; use a smaller model, fp8 weights "
            f"(--quantization fp8) or a larger --gpu-memory-utilization")
    budget = allowed - weights - peak_activation - graph_pool
    if budget <= 0:
        raise KVBudgetError(
            f"no memory is left for the KV cache: {utilization:.0%} of "
            f"{total / 2**30:.2f} GiB less {weights / 2**30:.2f} GiB of weights, "
            f"{peak_activation / 2**30:.2f} GiB of peak activations and "
            f"{graph_pool / 2**30:.2f} GiB of CUDA graphs; lower --max-num-batched-tokens "
            f"or raise --gpu-memory-utilization")
    return budget


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                             kv_cache_dtype: str = "auto") -> int:
    """K and V, every layer, one block of tokens; an 8-bit cache (--kv-cache-dtype int8 /
    fp8) is one byte per element plus one fp32 scale per (token, kv head)."""
    if kv_format(kv_cache_dtype) is not None:
        row = config.head_dim + SCALE_BYTES
    else:
        row = config.head_dim * torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * row


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cuda_memory_in_use(device: torch.device) -> tuple[int, int, int]:
    """(total, weights, peak activations) in bytes, read from torch's allocator after
    the weights are loaded. The peak is what the allocator saw beyond the weights
    (the engine's profile forward at max_num_batched_tokens, when one ran); memory
    other processes hold counts as used, as vLLM counts it."""
    free, total = torch.cuda.mem_get_info(device)
    weights = torch.cuda.memory_allocated(device)
    others = total - free - torch.cuda.memory_reserved(device)
    peak = max(0, torch.cuda.max_memory_allocated(device) - weights)
    return total, weights + max(0, others), peak


def choose_num_blocks(config: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                      device: torch.device, max_model_len: int, max_num_seqs: int,
                      graph_share: float = 0.0) -> int:
    """graph_share: the CUDA-graph pool as a share of the profiled peak activations
    (it holds the largest decode bucket's activations, max_num_seqs tokens against
    the profile's max_num_batched_tokens); 0 without graphs."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = kv_cache_bytes_per_block(config, cache.block_size, dtype, cache.kv_cache_dtype)
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif device.type == "cuda":
        total, weights, peak = cuda_memory_in_use(device)
        utilization = cache.memory_utilization or CUDA_DEFAULT_UTILIZATION
        budget = cuda_kv_budget_bytes(total, weights, peak, int(peak * graph_share),
                                      utilization)
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
