"""Engine flags shared by `serve`, `generate`, `chat` and `bench --offline`,
named as vLLM's."""

from __future__ import annotations

import argparse
import re

from tokenmill.cli.lora_args import add_lora_args, lora_config_kwargs
from tokenmill.config import (
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
)
from tokenmill.distributed.launch import add_launch_args

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1e9', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}; use bytes or a unit like 512MiB, 2GiB, 1GB")
    try:
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}") from e
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return int(value)


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _kv_transfer_config(text: str) -> KVTransferConfig:
    try:
        return KVTransferConfig.from_json(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = True,
                    max_num_seqs: int = 256, max_num_batched_tokens: int = 2048) -> None:
    """max_num_seqs: the flag's default, vLLM's on a CPU: 256 offline, 128 for a server.
    max_num_batched_tokens: 2048 offline (W1 ran 4% faster than at 1024 and at 4096,
    vLLM's CPU default for its LLM class); a server's is smaller (256), so that prompts
    arriving together are prefilled a few a step, each streaming its first token early,
    instead of all of them in one long step (BENCHMARKS.md, "A server's token budget")."""
    if model_positional:
        parser.add_argument("model", nargs="?", default="smollm2-135m",
                            help="smollm2-135m (embedded), a .gguf file or an HF checkpoint dir")
    else:
        parser.add_argument("--model", default="smollm2-135m")
    g = parser.add_argument_group("engine")
    g.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "half", "float"])
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--quantization", default=None,
                   choices=["auto", "none", "int8", "int4", "gguf", "gguf-a8", "gguf-a16",
                            "gguf-triton", "fp8"],
                   help="weight format; auto (the default): the fastest correct one for the "
                   "checkpoint, for a GGUF on CPU gguf-a8 on AVX512-VNNI and gguf-a16 on "
                   "AVX2 (TOKENMILL_GGUF_DEFAULT forces one; docs/accuracy_gate.md)")
    g.add_argument("--batched-linears", default="auto",
                   choices=["auto", "bf16", "w8a8", "int16", "mlp-int8", "int8", "none"],
                   help="weights the low-bit linears use for many rows a step: bf16 (packed "
                   "for oneDNN), w8a8 (int8 weights x per-token int8 activations on "
                   "AVX512-VNNI), int16 (gguf-a16's own integers widened, on AVX2) or "
                   "mlp-int8 (the MLP's GGUF integers x int8 activations on AVX512-VNNI, "
                   "attention's linears bf16), int8 (the attention's too), none (the low-bit "
                   "kernels at every batch, no copy; on a GPU, gguf-triton's prompt "
                   "chunks dequantize each linear's blocks for the call); "
                   "auto: none where the bf16 copy would exceed 1 GiB, int16 for gguf-a16 "
                   "on AVX2 without native bf16, mlp-int8 for gguf-a8/gguf-a16 on AVX512-VNNI "
                   "(it passed the accuracy gate on every gated file; int8 for a Gemma 3 "
                   "file on gguf-a8, whose gate passes it), else bf16")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights at the checkpoint's shapes (speed checks)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="default: the model's own context, capped by what the KV cache holds")
    g.add_argument("--max-num-seqs", type=int, default=max_num_seqs,
                   help=f"sequences in one step (default {max_num_seqs}, as vLLM on a CPU)")
    g.add_argument("--max-num-batched-tokens", type=int, default=max_num_batched_tokens,
                   help=f"tokens per step (default {max_num_batched_tokens}; with "
                   "--no-enable-chunked-prefill raised to max-model-len, as vLLM)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="split long prompts over steps (default on)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache budget in bytes (e.g. 1GiB); default: a share of free memory")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="as vLLM on CUDA (share of the GPU's memory for the instance); on a "
                   "CPU the share of available RAM for the KV cache (default there: "
                   "min(15%% of RAM, 2 GiB))")
    g.add_argument("--kv-cache-prefault", action="store_true",
                   help="touch the whole KV pool at start-up: RSS reaches its steady state "
                   "at once and no request pays first-touch page faults")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage: auto (the model's dtype), bfloat16, int8 or fp8 "
                        "(= fp8_e4m3), fp8_e5m2: 8-bit with a scale per token and KV head, "
                        "half the bytes, so the same --kv-cache-memory holds 2x the tokens")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_true", default=True)
    g.add_argument("--no-prefix-caching", "--no-enable-prefix-caching",
                   dest="enable_prefix_caching", action="store_false")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--kv-events-config", type=_kv_events_config, default=None, metavar="JSON",
                   help="publish prefix-cache changes in vLLM's KV-event format, e.g. "
                        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                        "\"endpoint\": \"tcp://*:5557\", \"topic\": \"\"}' "
                        "(docs/scale-out.md)")
    g.add_argument("--kv-transfer-config", type=_kv_transfer_config, default=None,
                   metavar="JSON",
                   help="prefill/decode disaggregation behind vllm-router's "
                        "--vllm-pd-disaggregation: '{\"kv_role\": \"kv_producer\"}' on the "
                        "prefill instance, '{\"kv_role\": \"kv_consumer\"}' on the decode "
                        "one (docs/scale-out.md)")
    g.add_argument("--attention-backend", default="auto", metavar="NAME",
                   help="attention kernels: auto (cpu on a CPU), torch (the plain "
                        "reference), cpu (native kernels); an unavailable one is an error")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps as built, without CUDA graphs (on a CPU: without "
                        "the padded static-buffer path the graphs replay)")
    g.add_argument("--async-scheduling", dest="async_scheduling", action="store_const",
                   const=True, default=None,
                   help="schedule and prepare step N+1 while step N computes; outputs "
                        "arrive one step later; steps that need the host's tokens first "
                        "(structured output, penalties, bad_words, prompt logprobs, "
                        "speculative decoding) run synchronously (default: on with CUDA, "
                        "off on CPU)")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_const",
                   const=False, help="run every step synchronously (the CPU's default)")
    g.add_argument("--debug-kv-integrity", action="store_true",
                   help="check KV block ref counts, free list and prefix-cache hashes "
                        "after every step, and stop on the first violation (slow)")
    add_launch_args(parser)
    add_lora_args(parser)
    s = parser.add_argument_group("speculative decoding")
    s.add_argument("--speculative", default=None, choices=["ngram", "draft", "layerskip"],
                   help="propose tokens and verify them in one forward (exact: same outputs)")
    s.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="draft tokens proposed per step")
    s.add_argument("--ngram-min", type=int, default=2)
    s.add_argument("--ngram-max", type=int, default=4)
    s.add_argument("--draft-model", default=None,
                   help="--speculative draft: a smaller model with the same tokenizer")
    s.add_argument("--draft-layers", type=int, default=None,
                   help="--speculative layerskip: the target's first L layers draft "
                        "(default: a quarter of them)")
    s.add_argument("--spec-max-batch", type=int, default=8,
                   help="no speculation while more sequences than this are running")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        batched_linears=args.batched_linears,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        seed=args.seed,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        debug_kv_integrity=args.debug_kv_integrity,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        draft_model=args.draft_model,
        draft_layers=args.draft_layers,
        spec_max_batch=args.spec_max_batch,
        tensor_parallel_size=args.tensor_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        **lora_config_kwargs(args),
        cache=CacheConfig(
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory,
            memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_events=args.kv_events_config,
            kv_transfer=args.kv_transfer_config,
            kv_cache_dtype=args.kv_cache_dtype,
            prefault=args.kv_cache_prefault,
        ),
    )
