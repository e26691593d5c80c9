"""What a running tokenmill is configured to do, as one JSON-able dict (`GET /server_info`).

`tokenmill bench` records it into the result (`config.server_config`) and `tokenmill
explain` reads it, so that explain does not recommend a lever the run already pulled
(prefix caching that is on, chunked prefill that tokenmill always does). The keys follow
vLLM's engine-argument names where one exists.
"""

from __future__ import annotations

from typing import Any

from tokenmill.version import __version__


def server_info(llm: Any) -> dict[str, Any]:
    """`llm`: an LLMEngine (duck-typed: its `config`, and what it resolved at start-up)."""
    config = llm.config
    cache = config.cache
    stats = llm.get_stats() if hasattr(llm, "get_stats") else None
    # per tensor class the GGUF types and record forms, bytes, float copies and why
    weights = getattr(getattr(getattr(llm, "runner", None), "model", None), "weight_forms",
                      None)
    return {
        "engine": "tokenmill",
        "version": __version__,
        "model": getattr(llm, "model_name", config.model),
        "model_path": str(config.model),  # what was loaded: explain finds the file by it
        "dtype": str(getattr(llm, "dtype", config.dtype)).removeprefix("torch."),
        "quantization": getattr(llm, "quantization", config.quantization),
        # why that method: "gguf-a8: default on AVX-512 VNNI (accuracy gate: ...)"
        "quantization_reason": weights.get("method_reason") if isinstance(weights, dict)
        else None,
        "batched_linears": getattr(config, "batched_linears", "auto"),
        "async_scheduling": getattr(config, "async_scheduling", False),
        "device": str(getattr(getattr(llm, "runner", None), "device", config.device)),
        "max_model_len": getattr(llm, "max_model_len", config.max_model_len),
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_chunked_prefill": getattr(config, "enable_chunked_prefill", True),
        "enable_prefix_caching": cache.enable_prefix_caching,
        "block_size": cache.block_size,
        "kv_cache_dtype": getattr(cache, "kv_cache_dtype", "auto"),
        "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
        # what the KV pool allocated (rank 0's), whichever way its size was chosen
        "kv_pool_bytes": getattr(getattr(llm, "runner", None), "kv_cache_bytes", None),
        "num_kv_blocks": stats.num_total_blocks if stats is not None else cache.num_kv_blocks,
        "tensor_parallel_size": getattr(config, "tensor_parallel_size", 1),
        # each rank's weights (parameters and quantized blocks), rank 0 first
        "tensor_parallel_weight_bytes": getattr(getattr(llm, "workers", None),
                                                "rank_parameter_bytes", None),
        "weights": weights,
        "speculative": config.speculative,
        "num_speculative_tokens": config.num_speculative_tokens if config.speculative else None,
        "attention_layers": _attention_layers(llm),
        # prefill/decode disaggregation: this instance's kv_role, or None
        "kv_transfer": getattr(getattr(cache, "kv_transfer", None), "kv_role", None),
        # the packed matmuls' oneDNN compile (rank 0's; a server runs it in the background
        # once it answers): {"state", "shapes", "seconds", "why"}
        "onednn_precompile": _precompile(llm),
    }


def _precompile(llm: Any) -> dict[str, Any] | None:
    precompile = getattr(llm, "precompile", None)
    return precompile.describe() if precompile is not None else None


def _attention_layers(llm: Any) -> dict[str, Any] | None:
    """Sliding / global layers and the KV bytes per sequence (kvcache/attention_groups.py)."""
    groups = getattr(llm, "attention_groups", None)
    max_len = getattr(llm, "max_model_len", None)
    return groups.describe(max_len) if groups is not None and max_len else None
