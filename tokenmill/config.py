"""Configuration dataclasses; each validates itself and is passed only where needed."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",  # its text part only (models/gemma3.py)
    "Phi3ForCausalLM",  # models/phi3.py
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass
class ModelConfig:
    """The architecture of a Llama-family decoder, in Hugging Face's terms."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    sliding_window: int | None = None
    # Gemma 3 (models/gemma3.py): per layer "sliding_attention" or "full_attention";
    # the local layers' RoPE base; queries scaled by query_pre_attn_scalar ** -0.5
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # Phi-4-mini: RoPE on the first partial_rotary_factor * head_dim dims only
    partial_rotary_factor: float = 1.0
    # Mixture-of-Experts (models/moe.py); num_experts 0: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's; intermediate_size is the dense MLPs'
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # Qwen3-MoE: every n-th layer is sparse
    mlp_only_layers: tuple[int, ...] = ()  # Qwen3-MoE: layers kept dense

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; tokenmill runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.architecture in MOE_ARCHITECTURES:
            if self.num_experts < 1:
                raise ValueError(f"{self.architecture} needs num_experts >= 1, "
                                 f"got {self.num_experts}")
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be "
                                 f"between 1 and num_experts ({self.num_experts})")
            if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
                raise ValueError("moe_intermediate_size and decoder_sparse_step must be >= 1")

    def is_sparse_layer(self, index: int) -> bool:
        """Layer `index` has a routed MoE block instead of a dense MLP (Qwen3-MoE's rule)."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it attends to the whole context)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if cfg.get("model_type") in ("gemma3", "gemma3_text") or \
                (archs and archs[0].startswith("Gemma3")):
            from tokenmill.config_gemma3 import gemma3_config

            return gemma3_config(cls, cfg)
        if cfg.get("model_type") == "phi3" or (archs and archs[0] == "Phi3ForCausalLM"):
            from tokenmill.config_phi3 import phi3_config

            return phi3_config(cls, cfg)
        arch = archs[0] if archs else {
            "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
        }.get(cfg.get("model_type", ""), str(cfg.get("model_type")))
        n_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // n_heads
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta")
            or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            hidden_act=cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window") else None,
            **_moe_fields(arch, cfg),
        )


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a Hugging Face config: Qwen3-MoE's names, or Mixtral's (whose
    experts are intermediate_size wide and always renormalized over the top k)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if arch == "MixtralForCausalLM":
        return {"num_experts": experts, "num_experts_per_tok": cfg.get("num_experts_per_tok", 2),
                "moe_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True}
    return {"num_experts": experts, "num_experts_per_tok": cfg.get("num_experts_per_tok", 0),
            "moe_intermediate_size": cfg.get("moe_intermediate_size") or 0,
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "decoder_sparse_step": cfg.get("decoder_sparse_step") or 1,
            "mlp_only_layers": tuple(cfg.get("mlp_only_layers") or ())}


# --kv-cache-dtype values (vLLM's names, plus int8); "fp8" is e4m3, as in vLLM
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when enabled, as vLLM
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000  # accepted for vLLM compatibility; sends are synchronous
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv-events-config: publisher must be 'zmq' or 'null', "
                             f"got {self.publisher!r}")
        if self.buffer_steps < 1 or self.hwm < 0:
            raise ValueError("kv-events-config: buffer_steps must be >= 1 and hwm >= 0")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        return cls(**_json_fields(text, cls, "kv-events-config"))


def _json_fields(text: str, cls: type, flag: str) -> dict:
    """A flag's JSON object, every key a field of the dataclass `cls` (errors name the flag
    and the unknown fields)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise TypeError(f"{flag} must be a JSON object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{flag}: unknown field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    return raw


KV_CONNECTORS = ("ZmqConnector",)  # tokenmill/kvcache/transfer: ZMQ over TCP
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# connectors vLLM users may name that tokenmill does not implement, and why
_REFUSED_CONNECTORS = {
    "mooncake": "the Mooncake transfer engine is not supported (vllm-router's "
                "--kv-connector mooncake mode is refused too); use 'ZmqConnector'",
    "nixl": "NIXL (GPU RDMA) is not implemented; tokenmill's transport is 'ZmqConnector' "
            "(ZMQ over TCP), which vllm-router's default nixl mode routes to unchanged",
}


@dataclass
class KVTransferConfig:
    """vLLM's --kv-transfer-config, for prefill/decode disaggregation
    (docs/scale-out.md). kv_port None: the producer binds a free port and announces
    it in each request's kv_transfer_params, so one pair on a host needs no ports."""

    kv_role: str
    kv_connector: str = "ZmqConnector"
    kv_ip: str = "127.0.0.1"  # where the producer listens and what it announces
    kv_port: int | None = None
    engine_id: str | None = None  # None: a random id per start
    # a producer frees a finished request's blocks this long after it if nobody pulled
    # them; a consumer waits this long for a pull before prefilling itself
    pin_timeout_s: float = 60.0
    pull_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv-transfer-config: kv_role must be one of "
                             f"{', '.join(KV_ROLES)}, got {self.kv_role!r}")
        refused = next((why for key, why in _REFUSED_CONNECTORS.items()
                        if key in str(self.kv_connector).lower()), None)
        if refused is not None:
            raise ValueError(f"kv-transfer-config: kv_connector {self.kv_connector!r}: {refused}")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv-transfer-config: unknown kv_connector {self.kv_connector!r}; "
                             f"known: {', '.join(KV_CONNECTORS)}")
        if self.kv_port is not None and not (isinstance(self.kv_port, int)
                                             and 0 <= self.kv_port <= 65535):
            raise ValueError(f"kv-transfer-config: kv_port must be a port number 0-65535, "
                             f"got {self.kv_port!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv-transfer-config: kv_ip must be a host name or address, "
                             f"got {self.kv_ip!r}")
        for name in ("pin_timeout_s", "pull_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"kv-transfer-config: {name} must be a positive number "
                                 f"of seconds, got {value!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        raw = _json_fields(text, cls, "kv-transfer-config")
        if "kv_role" not in raw:
            raise ValueError("kv-transfer-config: kv_role is required (kv_producer, "
                             "kv_consumer or kv_both)")
        return cls(**raw)


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit block count wins over the byte budget
    kv_cache_memory_bytes: int | None = None  # None: a share of free RAM / GPU memory
    # vLLM's --gpu-memory-utilization: on CUDA the share of the GPU's memory for the
    # whole instance; on a CPU the share of available RAM for the KV cache
    memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    # vLLM's --kv-events-config: publish the prefix cache's changes for routers
    kv_events: KVEventsConfig | None = None
    # vLLM's --kv-transfer-config: prefill/decode disaggregation (kvcache/transfer)
    kv_transfer: KVTransferConfig | None = None
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    # --kv-cache-prefault: write the whole pool at start-up, so its pages are resident
    # (RSS at its steady state from the start, no first-touch page faults under load)
    prefault: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory must be positive")
        if self.kv_events is not None and self.kv_events.active and not self.enable_prefix_caching:
            raise ValueError("KV cache events describe the prefix cache: they need prefix "
                             "caching on (drop --no-enable-prefix-caching)")
        if self.memory_utilization is not None and not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; use "
                             f"{', '.join(KV_CACHE_DTYPES)}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # off: a prompt is admitted only when all of it fits in one step's budget
    enable_chunked_prefill: bool = True
    max_loras: int = 0  # distinct LoRA adapters among running sequences (0: no bound)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")


# --quantization methods that run a GGUF file's own blocks natively, and the activations
# each multiplies them by (tokenmill/quant/model.py; roofline holds each against the peak
# of that arithmetic). Here, torch-free, for both.
GGUF_ACTIVATIONS = {"gguf": "bf16", "gguf-a8": "int8", "gguf-a16": "int16"}
# ...except the attention's linears (qkv_proj, o_proj) of gguf-a8, at int16: all-int8
# activations failed the accuracy gate on the embedded Q4_1 file (mean KLD 0.00298 vs
# llama.cpp's 0.00278), int16 ones there pass (docs/accuracy_gate.md); the MLP and the
# LM head, most of the bytes, keep int8
GGUF_ATTENTION_ACTIVATIONS = {"gguf-a8": "int16"}
ATTENTION_LINEARS = ("qkv_proj", "o_proj")
# ...but for these architectures, whose gated files pass with it, gguf-a8's attention
# takes int8 as the rest does (llama.cpp's own arithmetic: Q8_0 activations for every
# linear): Gemma 3 270M, decode rows, full text, mean KLD 0.00256 [0.00249, 0.00264]
# vs llama.cpp's 0.00471 (docs/accuracy_gate.md); its decode step 1.05x faster at 16 rows
GGUF_INT8_ATTENTION_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")


def gguf_activations(method: str, linear: str, architecture: str | None = None) -> str:
    """The activations GGUF method `method` multiplies linear `linear`'s blocks by
    (`linear`: its module's name, "qkv_proj", "down_proj", "lm_head"...) in a model of
    `architecture` (a Hugging Face architecture name; None: any)."""
    if (linear in ATTENTION_LINEARS and method in GGUF_ATTENTION_ACTIVATIONS
            and architecture not in GGUF_INT8_ATTENTION_ARCHITECTURES):
        return GGUF_ATTENTION_ACTIVATIONS[method]
    return GGUF_ACTIVATIONS[method]


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    quantization: str | None = None  # None: the fastest correct default for the weights
    # the low-bit linears' weight for 8+ rows: auto | bf16 | w8a8 (tokenmill/quant/model.py)
    batched_linears: str = "auto"
    load_format: str = "auto"  # auto | dummy (random weights, the checkpoint's shapes)
    max_model_len: int | None = None  # None: the model's context, capped by the KV cache
    # vLLM's CPU defaults: 256 for the LLM class (offline), 128 for `serve` (its flag)
    max_num_seqs: int = 256
    # offline: 2048 (W1 ran 4% faster than at 1024 or 4096, BENCHMARKS.md 2026-12-05);
    # `serve` passes 256 (its flag's default)
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    # auto | torch | cpu | ... (tokenmill/attention); auto = cpu on a CPU. Checked
    # against the registry at engine start-up, where the device is known
    attention_backend: str = "auto"
    # vLLM's name: no CUDA graphs for decode (and on a CPU no static-buffer decode path)
    enforce_eager: bool = False
    # vLLM's name: schedule step N+1 while step N computes (engine/core/overlap.py);
    # None: on with CUDA, off on CPU (engine/core/async_default.py)
    async_scheduling: bool | None = None
    # check the block manager and prefix cache after every step (slow; for debugging)
    debug_kv_integrity: bool = False
    # speculative decoding (tokenmill/engine/speculative, docs/speculative.md)
    speculative: str | None = None  # None | ngram | draft | layerskip
    num_speculative_tokens: int = 4  # k: draft tokens per step
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str | None = None  # speculative="draft": same tokenizer as the model
    draft_layers: int | None = None  # speculative="layerskip": None = a quarter of the layers
    spec_max_batch: int = 8  # no speculation while more sequences than this run
    # tensor parallelism (tokenmill/distributed): ranks, and where they meet (torchrun's
    # flags); master_port 0: a free port, single node only
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    # LoRA adapters (vLLM's flags; tokenmill/engine/core/lora_manager.py): served
    # adapters as (name, path) pairs, adapters per batch, their largest rank, and how
    # many stay loaded in host memory (None: max_loras)
    enable_lora: bool = False
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float"):
            raise ValueError(
                f"unknown dtype {self.dtype!r}; use auto, float32, bfloat16 or float16"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.speculative not in (None, "ngram", "draft", "layerskip"):
            raise ValueError(f"unknown speculative method {self.speculative!r}; "
                             "use ngram, draft or layerskip")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("speculative='draft' needs draft_model")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError("draft_layers must be at least 1")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.tensor_parallel_size > 1 and self.speculative is not None:
            raise ValueError("speculative decoding does not run under tensor parallelism "
                             "yet: drop --speculative or use --tensor-parallel-size 1")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least "
                             f"--max-loras ({self.max_loras})")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("--enable-lora does not run under tensor parallelism yet: "
                             "use --tensor-parallel-size 1")
        if self.enable_lora and self.speculative is not None:
            raise ValueError("--enable-lora with --speculative is not supported yet: "
                             "drop one of them")
        if self.tensor_parallel_size > 1 and self.async_scheduling is True:
            # the workers take each step's input ids from rank 0's broadcast, and under
            # async scheduling some of those are still on rank 0's device
            raise ValueError("--async-scheduling does not run under tensor parallelism "
                             "yet: drop it or use --tensor-parallel-size 1")
