"""Start-up wiring: from an EngineConfig to the parts an LLMEngine steps — the
model on every rank, the KV cache's books, the scheduler, the sampler and its
constraints, the stop checker, the speculator — in the order they depend on
each other, with what start-up logs about memory."""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.attention import check_backend
from tokenmill.attention.quantized import check_kv_cache_dtype
from tokenmill.config import EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.distributed.parallel_state import get_tp
from tokenmill.engine.core.async_default import resolve_async_scheduling
from tokenmill.engine.core.detokenizer import Detokenizer
from tokenmill.engine.core.sampler import Sampler
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.core.stop_checker import StopChecker
from tokenmill.engine.core.validation import RequestValidator
from tokenmill.engine.executor.worker_group import check_tensor_parallel, start_workers
from tokenmill.engine.runner.onednn_caches import PackedPrecompile
from tokenmill.engine.runner.rank_model import build_rank_model
from tokenmill.kvcache.attention_groups import (
    AttentionGroups,
    attention_groups,
    log_attention_groups,
)
from tokenmill.kvcache.block_manager import BlockManager
from tokenmill.kvcache.event_stream import KVEventStream
from tokenmill.loaders import ModelSource, load_tokenizer, resolve_model
from tokenmill.loaders.deferred_tokenizer import DeferredTokenizer
from tokenmill.structured import GrammarCache, LogitsConstraints

logger = logging.getLogger("tokenmill.engine.core.llm_engine")  # start-up lines read as the engine's


def check_startup_choices(config: EngineConfig) -> torch.device:
    """The device, once a bad --attention-backend (or one that cannot read the
    --kv-cache-dtype) has failed in a moment, before any weights load. `tokenmill
    serve` calls it before it starts an engine core process, so the usage error
    is its own (exit 2, one line), not a dead core's."""
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto"
        else config.device)
    check_kv_cache_dtype(check_backend(config.attention_backend, device),
                         config.cache.kv_cache_dtype)
    check_tensor_parallel(config)  # ValueError: a size the model's shapes do not split
    return device


def process_rss_bytes() -> int:
    """This process's resident set (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class EngineParts:
    """What LLMEngine holds, as its attributes of the same names."""

    source: ModelSource
    model_name: str
    workers: Any  # tensor parallelism: the started worker group; None for one rank
    quantization: Any
    model_config: ModelConfig
    dtype: torch.dtype
    tokenizer: Any
    max_model_len: int
    runner: Any  # ModelRunner
    block_manager: BlockManager
    kv_events: KVEventStream | None
    scheduler: Scheduler
    eos_token_ids: set[int]
    grammars: GrammarCache
    constraints: LogitsConstraints
    sampler: Sampler
    detokenizer: Detokenizer | None
    stop_checker: StopChecker
    validator: RequestValidator
    speculator: Any  # engine/speculative: None unless --speculative
    attention_groups: AttentionGroups  # sliding / global layers and their KV bytes
    precompile: PackedPrecompile  # rank 0's packed-matmul compile (run, or for its owner)
    lora: Any = None  # engine/core/lora_manager.LoRAManager: None unless --enable-lora
    kv_transfer: Any = None  # engine/core/kv_transfer.KVTransferConnector (disabled: no flag)


def build_engine_parts(config: EngineConfig, detokenize: bool,
                       precompile_now: bool = True) -> EngineParts:
    """precompile_now=False: the packed matmuls' oneDNN compile is planned, not run (a
    server starts it on a background thread once it answers)."""
    baseline_rss_bytes = process_rss_bytes()  # the interpreter, torch, libraries
    device = check_startup_choices(config)
    torch.manual_seed(config.seed)
    source = resolve_model(config.model, need_weights=config.load_format != "dummy")
    workers = start_workers(config, source, device)
    try:
        rank = build_rank_model(config, source, get_tp().device or device)
    except BaseException:
        if workers is not None:
            workers.mark_broken("rank 0 failed to start")
            workers.close()
        raise
    loaded, runner = rank.loaded, rank.runner
    if workers is not None:
        workers.attach(runner, rank.parameter_bytes)
    if precompile_now:  # after the workers' join: they compile theirs meanwhile
        rank.precompile.run()
    if not detokenize and source.kind == "gguf" and loaded.config.eos_token_id is not None:
        # the core process: the front end tokenizes; the tokenizer built from this
        # file's metadata has its eos (tokenizer.ggml.eos_token_id) as the config does
        tokenizer: Any = DeferredTokenizer(source)
    else:
        tokenizer = load_tokenizer(source)
    block_size = config.cache.block_size
    block_manager = BlockManager(rank.num_blocks, block_size, config.cache.enable_prefix_caching)
    kv_events = KVEventStream.start(config.cache.kv_events, block_manager, device.type)
    step_tokens = config.max_num_batched_tokens
    if not config.enable_chunked_prefill:  # a whole prompt must fit one step, as vLLM
        step_tokens = max(step_tokens, rank.max_model_len)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=step_tokens,
                        max_model_len=rank.max_model_len,
                        enable_chunked_prefill=config.enable_chunked_prefill,
                        max_loras=config.max_loras if config.enable_lora else 0),
        block_manager)
    eos = eos_token_ids(loaded.config, tokenizer)
    grammars = GrammarCache(tokenizer, loaded.config.vocab_size, eos)
    constraints = LogitsConstraints(grammars)
    detokenizer = Detokenizer(tokenizer) if detokenize else None
    speculator = None
    if config.speculative:
        from tokenmill.engine.speculative import build_speculator

        speculator = build_speculator(config, runner, block_manager, rank.max_model_len,
                                      loaded.dtype)
    if config.cache.kv_transfer is not None and config.async_scheduling is None:
        config.async_scheduling = False  # the connector's installs run in the synchronous step
    config.async_scheduling = resolve_async_scheduling(  # None: per device
        config.async_scheduling, runner.device.type, config.tensor_parallel_size,
        config.speculative)
    lora = None
    if config.enable_lora:
        from tokenmill.engine.core.lora_manager import LoRAManager

        # never evict an adapter a queued or running sequence runs under
        lora = LoRAManager(runner.model, loaded.config, config, lambda: {
            s.lora_int_id for s in (*scheduler.running, *scheduler.waiting)}, loaded.dtype)
    kv_transfer = build_kv_transfer(config, loaded.config, runner, block_manager, scheduler)
    if config.cache.prefault:  # the pool was zeroed by build_rank_model
        block_manager.mark_all_touched()
    logger.info("engine ready: %s, dtype %s, %s attention, %d KV blocks of %d tokens "
                "(%.0f MiB)", source.name, loaded.dtype, runner.backend.name,
                rank.num_blocks, block_size, runner.kv_cache_bytes / 2**20)
    groups = attention_groups(loaded.config, runner.kv_cache_bytes // max(rank.num_blocks, 1),
                              block_size)
    log_attention_groups(logger, groups, rank.max_model_len)
    log_expected_rss(baseline_rss_bytes, loaded.model, device, runner.kv_cache_bytes,
                     block_manager)
    return EngineParts(
        source=source, model_name=source.name, workers=workers,
        quantization=rank.quantization, model_config=loaded.config, dtype=loaded.dtype,
        tokenizer=tokenizer, max_model_len=rank.max_model_len, runner=runner,
        block_manager=block_manager, kv_events=kv_events, scheduler=scheduler,
        eos_token_ids=eos, grammars=grammars, constraints=constraints,
        sampler=Sampler(eos_token_ids=eos, constraints=constraints), detokenizer=detokenizer,
        stop_checker=StopChecker(eos, rank.max_model_len, detokenizer),
        validator=RequestValidator(tokenizer, loaded.config.vocab_size, rank.max_model_len,
                                   rank.context_note, block_manager.max_tokens_that_fit),
        speculator=speculator, attention_groups=groups, precompile=rank.precompile, lora=lora,
        kv_transfer=kv_transfer)


def build_kv_transfer(config: EngineConfig, model_config: ModelConfig, runner: Any,
                      block_manager: BlockManager, scheduler: Scheduler) -> Any:
    """The prefill/decode connector (disabled without --kv-transfer-config); the
    combinations it does not handle refused by name."""
    from tokenmill.engine.core.kv_transfer import KVTransferConnector

    kv = config.cache.kv_transfer
    if kv is None:
        return KVTransferConnector(None)
    if model_config.sliding_window is not None:
        raise ValueError("--kv-transfer-config: sliding-window models (this one attends "
                         f"within {model_config.sliding_window} tokens on some layers) are "
                         "not supported: the wire format has no per-window block tables yet")
    refused = [name for name, on in (("--tensor-parallel-size > 1",
                                      config.tensor_parallel_size > 1),
                                     ("--speculative", bool(config.speculative)),
                                     ("--async-scheduling", bool(config.async_scheduling)),
                                     ("--enable-lora", config.enable_lora)) if on]
    if refused:
        raise ValueError(f"--kv-transfer-config is not supported with {', '.join(refused)}")
    connector = KVTransferConnector(kv, block_manager, runner, scheduler.config.max_num_seqs,
                                    model_config.vocab_size)
    if connector.producer is not None:
        scheduler.on_finished = connector.on_finished
    return connector


def eos_token_ids(model_config: ModelConfig, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    eos = model_config.eos_token_id
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if isinstance(tokenizer, DeferredTokenizer):  # the config's eos is the tokenizer's
        return ids
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def log_expected_rss(baseline_bytes: int, model: torch.nn.Module, device: torch.device,
                     kv_cache_bytes: int, block_manager: BlockManager) -> None:
    """The pool's pages are touched as blocks are first used, so RSS climbs
    under load up to this figure; saying so at start-up tells an operator
    that the climb is expected and where it stops. Measured, not estimated:
    what the process holds now, less the pool's pages already touched, plus the
    whole pool. "runtime" is what loading added besides the weights (libraries
    initialised on first use, the tokenizer, kernel builds)."""
    from tokenmill.quant.model import dense_copy_bytes

    weights = sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))
    weights += dense_copy_bytes(model)  # plain attributes, not buffers
    on_cpu = device.type == "cpu"
    kv = kv_cache_bytes if on_cpu else 0
    weights_host = weights if on_cpu else 0
    now = process_rss_bytes()
    touched = kv * block_manager.num_touched_blocks // max(1, block_manager.num_total_blocks)
    runtime = max(0, now - touched - baseline_bytes - weights_host)
    logger.info("expected steady-state RSS %.0f MiB = baseline %.0f MiB + weights "
                "%.0f MiB + runtime %.0f MiB + KV pool %.0f MiB (now %.0f MiB; the pool "
                "is touched as it fills, or at once with --kv-cache-prefault; under "
                "load a working heap for the batch shapes comes on top, docs/serving.md: "
                "Memory)",
                (baseline_bytes + weights_host + runtime + kv) / 2**20,
                baseline_bytes / 2**20, weights_host / 2**20, runtime / 2**20,
                kv / 2**20, now / 2**20)
