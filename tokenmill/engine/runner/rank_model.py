"""What every rank builds at start-up: its shard of the model, its KV pool, its runner.

Rank 0 (the engine) and each tensor-parallel worker run this same function in
the same order, so the collectives inside it line up: the CUDA profile
forward, and the agreement on one KV block count (the smallest any rank can
hold; each rank's pool holds only its own KV heads).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.distributed.parallel_state import get_tp
from tokenmill.engine.runner.heap_trim import fix_mmap_threshold
from tokenmill.engine.runner.model_runner import ModelRunner
from tokenmill.engine.runner.onednn_caches import PackedPrecompile, bound_onednn_caches
from tokenmill.engine.runner.weights import load_engine_model
from tokenmill.kvcache.budget import choose_num_blocks
from tokenmill.loaders import LoadedModel, ModelSource
from tokenmill.startup_timer import mark

logger = logging.getLogger(__name__)


@dataclass
class RankModel:
    loaded: LoadedModel
    quantization: str  # the tokenmill.quant method the weights run
    runner: ModelRunner
    num_blocks: int
    max_model_len: int
    context_note: str  # why max_model_len is below the model's, if it is
    # the packed matmuls' oneDNN compile, planned, not run: its owner runs or starts it
    precompile: PackedPrecompile

    @property
    def parameter_bytes(self) -> int:
        """This rank's weights: parameters and buffers (quantized blocks live in buffers)."""
        model = self.loaded.model
        seen: set[int] = set()
        total = 0
        for t in [*model.parameters(), *model.buffers()]:
            if t.data_ptr() not in seen:  # a tied head counts once
                seen.add(t.data_ptr())
                total += t.nbytes
        return total


def rank_config(config: ModelConfig, model: torch.nn.Module) -> ModelConfig:
    """The model config as this rank's KV pool sees it: its own heads only."""
    layer = next(iter(model.attention_layers()))
    return dataclasses.replace(config, num_attention_heads=layer.num_heads,
                               num_key_value_heads=layer.num_kv_heads)


def build_rank_model(config: EngineConfig, source: ModelSource,
                     device: torch.device) -> RankModel:
    torch.manual_seed(config.seed)
    bound_onednn_caches()  # before the first oneDNN primitive, which reads them
    fix_mmap_threshold()  # opt-in (TOKENMILL_MMAP_THRESHOLD): see heap_trim
    tp = get_tp()
    loaded, quantization = load_engine_model(source, config.dtype, config.quantization,
                                             device, config.load_format,
                                             config.batched_linears)
    model_max = loaded.config.max_position_embeddings
    max_model_len = min(config.max_model_len or model_max, model_max)
    context_note = ""
    block_size = config.cache.block_size
    # "auto": the model's dtype; 8-bit formats store bytes + scales (attention/quantized)
    kv_dtype = torch.bfloat16 if config.cache.kv_cache_dtype == "bfloat16" else loaded.dtype
    graph_share = 0.0
    capture = tp.world_size == 1  # NCCL collectives are not captured into graphs here
    if device.type == "cuda":  # the KV budget subtracts this forward's peak
        profile_activations(loaded.model, config.max_num_batched_tokens, config.max_num_seqs,
                            max_model_len, device)
        if not config.enforce_eager and capture:
            graph_share = min(1.0, config.max_num_seqs / config.max_num_batched_tokens)
    num_blocks = choose_num_blocks(rank_config(loaded.config, loaded.model), config.cache,
                                   kv_dtype, device, max_model_len, config.max_num_seqs,
                                   graph_share)
    num_blocks = tp.min_int(num_blocks)  # every rank's pool has the same blocks
    if config.max_model_len is None and max_model_len > num_blocks * block_size:
        # as vLLM: the model's own context by default, but never more than fits
        if tp.is_driver:
            logger.warning("max_model_len is %d, not the model's %d: the KV cache holds %d "
                           "tokens (raise --kv-cache-memory or --gpu-memory-utilization)",
                           num_blocks * block_size, model_max, num_blocks * block_size)
        max_model_len = num_blocks * block_size
        context_note = " (all the KV cache holds; raise --kv-cache-memory)"
    runner = ModelRunner(loaded.model, loaded.config, block_size, num_blocks, kv_dtype, device,
                         config.attention_backend, config.cache.kv_cache_dtype,
                         max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
                         enforce_eager=config.enforce_eager, capture_graphs=capture)
    if config.cache.prefault:
        runner.pool.zero_blocks(list(range(num_blocks)))
    precompile = PackedPrecompile.plan(loaded.model, config.max_num_batched_tokens,
                                       min(config.max_num_seqs, config.max_num_batched_tokens))
    if device.type == "cpu" and tp.is_driver and precompile.state == "skipped":
        logger.info("packed matmuls: compiled at first use (%s)", precompile.why_not)
    mark("KV cache allocated, model runner built (kernels, warm-up)")
    return RankModel(loaded, quantization, runner, num_blocks, max_model_len, context_note,
                     precompile)


@torch.inference_mode()
def profile_activations(model: torch.nn.Module, num_tokens: int, num_logit_rows: int,
                        max_model_len: int, device: torch.device) -> None:
    """One forward of num_tokens (one causal sequence, no KV cache) and the logits of
    num_logit_rows, so that torch's peak-memory counter holds the activations of the
    largest step the scheduler can build (kvcache/budget.py reads it)."""
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    pos = torch.arange(num_tokens, device=device) % max_model_len
    hidden = model(ids, pos)  # (T, hidden)
    model.compute_logits(hidden[:num_logit_rows])
    del hidden
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
