"""Model architecture → parameter, byte and FLOP counts, from an HF-style config dict.

Counts come from the shapes in the config, never from a model's name. Handles GQA,
tied embeddings, MoE (routed + shared experts, dense leading layers), DeepSeek MLA
(compressed KV), sliding-window layers, and quantized weights (bits per weight incl.
scales).
"""

from __future__ import annotations

from dataclasses import dataclass


def _get(config: dict, *keys: str, default=None):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


@dataclass(frozen=True)
class ModelArch:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int | None = None
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over q and k per head
    sandwich_norms: bool = False  # Gemma 3: norms before and after attention and MLP
    attention_bias: bool = False  # Qwen2: bias on q, k, v
    # MoE; num_experts == 0 means dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_dense_layers: int = 0  # leading layers with a dense MLP (DeepSeek first_k_dense_replace)
    router_bias: bool = False  # DeepSeek-V3 e_score_correction_bias
    # MLA (DeepSeek-V2/V3); kv_lora_rank == 0 means ordinary multi-head / GQA attention
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # per layer: attention window in tokens, or None for full attention
    layer_windows: tuple[int | None, ...] = ()
    torch_dtype: str = "bfloat16"
    native_quantization: str | None = None  # e.g. "fp8" from quantization_config
    architecture: str | None = None  # config.json's architectures[0], e.g. "LlamaForCausalLM"

    @classmethod
    def from_config(cls, config: dict, name: str | None = None) -> ModelArch:
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                               "num_attention_heads") if config.get(k) is None]
        if missing:
            raise ValueError(f"config lacks {', '.join(missing)}: not a decoder LLM config?")
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        num_experts = int(_get(config, "num_local_experts", "n_routed_experts", "num_experts",
                               default=0))
        windows = _layer_windows(config, layers)
        quant = config.get("quantization_config") or {}
        return cls(
            name=name or config.get("_preset") or config.get("_name_or_path") or "model",
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(_get(config, "num_key_value_heads", default=heads)),
            head_dim=int(_get(config, "head_dim", default=hidden // heads)),
            intermediate_size=int(_get(config, "intermediate_size", default=4 * hidden)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=_get(config, "max_position_embeddings"),
            qk_norm=config.get("model_type") in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
            sandwich_norms=config.get("model_type") in ("gemma3", "gemma3_text"),
            attention_bias=bool(config.get("attention_bias",
                                           config.get("model_type") in ("qwen2", "qwen2_moe"))),
            num_experts=num_experts,
            num_experts_per_tok=int(_get(config, "num_experts_per_tok", default=0))
            if num_experts else 0,
            num_shared_experts=int(_get(config, "n_shared_experts", default=0)),
            moe_intermediate_size=int(_get(config, "moe_intermediate_size", "intermediate_size",
                                           default=4 * hidden)),
            num_dense_layers=int(_get(config, "first_k_dense_replace", default=0))
            if num_experts else layers,
            router_bias=config.get("topk_method") == "noaux_tc",
            q_lora_rank=int(_get(config, "q_lora_rank", default=0)),
            kv_lora_rank=int(_get(config, "kv_lora_rank", default=0)),
            qk_nope_head_dim=int(_get(config, "qk_nope_head_dim", default=0)),
            qk_rope_head_dim=int(_get(config, "qk_rope_head_dim", default=0)),
            v_head_dim=int(_get(config, "v_head_dim", default=0)),
            layer_windows=windows,
            torch_dtype=str(_get(config, "torch_dtype", "dtype", default="bfloat16")),
            native_quantization=quant.get("quant_method"),
            architecture=(config.get("architectures") or [None])[0],
        )

    # ---- structure -------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    # ---- parameter counts ------------------------------------------------------------

    def attention_linear_params(self) -> int:
        """Matmul weights of one layer's attention (q, k, v, o or their MLA equivalents)."""
        h = self.hidden_size
        if self.is_mla:
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk_head
            else:
                q = h * self.num_heads * qk_head
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            o = self.num_heads * self.v_head_dim * h
            return q + kv_a + kv_b + o
        q_dim = self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        return h * q_dim + 2 * h * kv_dim + q_dim * h

    def layer_small_params(self) -> int:
        """Norms and biases of one layer (kept in 16/32-bit even in quantized checkpoints)."""
        small = (4 if self.sandwich_norms else 2) * self.hidden_size  # the RMSNorms
        if self.qk_norm:
            small += 2 * self.head_dim
        if self.attention_bias:
            small += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if self.is_mla:
            small += self.kv_lora_rank + self.q_lora_rank  # kv_a / q_a layernorms
        return small

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size  # gate, up, down

    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def router_params(self) -> int:
        return self.num_experts * self.hidden_size + (self.num_experts if self.router_bias else 0)

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        """0 when tied: the LM head reuses the embedding matrix, counted once."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def layer_linear_params(self) -> int:
        """Non-expert matmul weights of all layers: attention, dense MLPs, shared experts, routers."""
        moe_layer = self.num_shared_experts * self.expert_params() + self.router_params()
        return (self.num_layers * self.attention_linear_params()
                + self.num_dense_layers * self.dense_mlp_params()
                + self.num_moe_layers * moe_layer)

    def routed_expert_params(self) -> int:
        return self.num_moe_layers * self.num_experts * self.expert_params()

    def small_params(self) -> int:
        return self.num_layers * self.layer_small_params() + self.hidden_size  # + final norm

    def total_params(self) -> int:
        return (self.embedding_params() + self.lm_head_params() + self.layer_linear_params()
                + self.routed_expert_params() + self.small_params())

    def active_params(self) -> int:
        """Parameters one token touches (MoE: only its top-k routed experts)."""
        active_experts = self.num_moe_layers * self.num_experts_per_tok * self.expert_params()
        return (self.embedding_params() + self.lm_head_params() + self.layer_linear_params()
                + active_experts + self.small_params())

    def expected_distinct_experts(self, num_tokens: float) -> float:
        """Routed experts one MoE layer touches for `num_tokens` tokens, under uniform routing.

        Each token picks k of E experts; an expert is missed by all with (1 - k/E)^n.
        """
        if not self.is_moe or num_tokens <= 0:
            return 0.0
        e, k = self.num_experts, self.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** num_tokens)

    # ---- KV cache --------------------------------------------------------------------

    def kv_elements_per_token_per_layer(self) -> int:
        if self.is_mla:  # the compressed latent plus the shared rope key, for all heads
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, kv_bytes_per_element: float) -> float:
        """KV bytes one token adds with full attention in every layer."""
        return self.num_layers * self.kv_elements_per_token_per_layer() * kv_bytes_per_element

    def kv_bytes_at_context(self, context: int, kv_bytes_per_element: float) -> float:
        """KV bytes one sequence holds (and a decode step reads) at `context` tokens.

        A sliding-window layer keeps only its last `window` tokens.
        """
        per_layer = self.kv_elements_per_token_per_layer() * kv_bytes_per_element
        return sum(min(context, w) if w else context for w in self._windows()) * per_layer

    def _windows(self) -> tuple[int | None, ...]:
        return self.layer_windows or (None,) * self.num_layers

    # ---- FLOPs -----------------------------------------------------------------------

    def matmul_params_per_token(self, with_lm_head: bool = True) -> int:
        """Weights a token multiplies (2 FLOPs each); the embedding lookup is a gather."""
        active_experts = self.num_moe_layers * self.num_experts_per_tok * self.expert_params()
        lm_head = self.vocab_size * self.hidden_size if with_lm_head else 0
        return self.layer_linear_params() + active_experts + lm_head

    def attention_linear_params_per_token(self) -> int:
        """The attention's matmul weights a token multiplies, every layer's."""
        return self.num_layers * self.attention_linear_params()

    def attention_flops_per_token(self, context: float) -> float:
        """QKᵀ and PV for one query token attending to `context` cached tokens.

        MLA is counted in its absorbed decode form (scores over the 512+64-wide latent).
        """
        if self.is_mla:
            width = 2 * self.kv_lora_rank + self.qk_rope_head_dim
        else:
            width = 2 * self.head_dim
        per_layer_ctx = sum(min(context, w) if w else context for w in self._windows())
        return 2.0 * self.num_heads * width * per_layer_ctx

    def prefill_attention_flops(self, prompt_len: int) -> float:
        """Causal attention over a prompt: token i attends to i+1 tokens (≈ n²/2)."""
        if self.is_mla:  # prefill runs MLA un-absorbed: per-head q·k (192) and p·v (128)
            width = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        else:
            width = 2 * self.head_dim
        n = prompt_len
        total = 0.0
        for w in self._windows():
            if w and w < n:  # first w tokens ramp up, the rest attend to w each
                total += w * (w + 1) / 2 + (n - w) * w
            else:
                total += n * (n + 1) / 2
        return 2.0 * self.num_heads * width * total


def _layer_windows(config: dict, layers: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if layer_types and window:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    pattern = config.get("sliding_window_pattern")
    if window and pattern:  # Gemma 3's released configs: every pattern-th layer global
        return tuple(None if (i + 1) % int(pattern) == 0 else int(window) for i in range(layers))
    if window and config.get("use_sliding_window", True):
        max_window_layers = config.get("max_window_layers")
        if max_window_layers is not None and "use_sliding_window" in config:
            # Qwen2 convention: layers at index >= max_window_layers use the window
            return tuple(int(window) if i >= max_window_layers else None for i in range(layers))
        return (int(window),) * layers
    return (None,) * layers


# ---- weights on disk: bits per weight -------------------------------------------------

# bits per weight including per-block scales/mins, for dtype names users type
FLOAT_BITS = {"fp32": 32.0, "fp16": 16.0, "bf16": 16.0, "fp8": 8.0}
# int8: per-channel scale (negligible); int4: group 128 with a 16-bit scale and zero point
INT_BITS = {"int8": 8.0, "int4": 4.25}
DTYPE_ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
                 "float8": "fp8", "float8_e4m3fn": "fp8", "w8a16": "int8", "w4a16": "int4",
                 "awq": "int4", "gptq": "int4"}


def gguf_bits_per_weight(type_name: str) -> float | None:
    """Bits per weight of a GGUF/ggml tensor type, scales included (Q4_1 → 5.0, Q8_0 → 8.5)."""
    import gguf  # lazy: pulls in numpy

    try:
        qtype = gguf.GGMLQuantizationType[type_name.upper()]
    except KeyError:
        return None
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return type_size * 8.0 / block_size


def known_dtypes() -> list[str]:
    return [*FLOAT_BITS, *INT_BITS, "q8_0", "q6_k", "q5_k", "q4_k", "q4_1", "q4_0", "q3_k",
            "q2_k", "..."]


@dataclass(frozen=True)
class WeightBits:
    """Bits per weight for each group of tensors, and the dtype that does the math."""

    name: str
    linear: float  # layer matmul weights (attention, dense MLP, shared experts, routers)
    experts: float  # routed experts
    embedding: float
    lm_head: float
    small: float  # norms and biases
    compute_dtype: str  # dtype of the matmuls: picks the FLOP/s peak
    # the attention's q/k/v/o matmuls' dtype where it differs (gguf-a8: int16 there
    # except for config.GGUF_INT8_ATTENTION_ARCHITECTURES); None: compute_dtype
    attention_compute_dtype: str | None = None

    @classmethod
    def from_name(cls, dtype: str) -> WeightBits:
        key = dtype.lower().removeprefix("torch.")
        key = DTYPE_ALIASES.get(key, key)
        if key in FLOAT_BITS:
            bits = FLOAT_BITS[key]
            # fp8 checkpoints (DeepSeek-V3, FP8 W8A8) keep embeddings and LM head in bf16
            edge = 16.0 if key == "fp8" else bits
            return cls(key, bits, bits, edge, edge, max(bits, 16.0),
                       "fp32" if key == "fp32" else key)
        if key in INT_BITS:
            # weight-only int8/int4 (AWQ, GPTQ, torchao) leave embeddings and LM head in bf16
            bits = INT_BITS[key]
            return cls(key, bits, bits, 16.0, 16.0, 16.0, "bf16")
        bits = gguf_bits_per_weight(key)
        if bits is None:
            raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(known_dtypes())}")
        # llama.cpp quantizes every matmul weight, embedding included; norms stay F32
        return cls(key, bits, bits, bits, bits, 32.0, "bf16")

    def weight_bytes(self, arch: ModelArch) -> float:
        """Bytes of all weights at rest (what must fit in memory)."""
        return (arch.layer_linear_params() * self.linear
                + arch.routed_expert_params() * self.experts
                + arch.embedding_params() * self.embedding
                + arch.lm_head_params() * self.lm_head
                + arch.small_params() * self.small) / 8.0

    def bytes_read_per_step(self, arch: ModelArch, num_tokens: float) -> float:
        """Weight bytes one forward step over `num_tokens` tokens must read.

        Routed experts: only the distinct ones the tokens pick. Untied embedding table: only
        the gathered rows. A tied table is read whole, as the LM head.
        """
        expert_bytes = (arch.num_moe_layers * arch.expected_distinct_experts(num_tokens)
                        * arch.expert_params() * self.experts)
        if arch.tie_word_embeddings:
            table = arch.embedding_params() * self.embedding
        else:
            rows = min(num_tokens, arch.vocab_size) * arch.hidden_size * self.embedding
            table = rows + arch.lm_head_params() * self.lm_head
        return (arch.layer_linear_params() * self.linear + expert_bytes + table
                + arch.small_params() * self.small) / 8.0


def default_dtype(arch: ModelArch) -> str:
    if arch.native_quantization in FLOAT_BITS:
        return arch.native_quantization
    return DTYPE_ALIASES.get(arch.torch_dtype, "bf16") if arch.torch_dtype else "bf16"


def gguf_weight_bits(reader) -> WeightBits:
    """Bits per weight of each tensor group, measured from the tensor types in a GGUF file
    (a `gguf.GGUFReader`).

    Summing these back over the architecture's parameter counts gives the file's tensor bytes.
    """
    groups: dict[str, list[int]] = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name == "token_embd.weight":
            group = "embedding"
        elif name == "output.weight":
            group = "lm_head"
        elif "_exps." in name:
            group = "experts"
        elif len(tensor.shape) == 1 or int(tensor.n_elements) == int(tensor.shape[0]):
            group = "small"
        else:
            group = "linear"
        acc = groups.setdefault(group, [0, 0])
        acc[0] += int(tensor.n_bytes)
        acc[1] += int(tensor.n_elements)

    def bits(group: str, fallback: float) -> float:
        n_bytes, n_elements = groups.get(group, (0, 0))
        return n_bytes * 8.0 / n_elements if n_elements else fallback

    linear = bits("linear", 16.0)
    types = sorted({t.tensor_type.name for t in reader.tensors if len(t.shape) > 1})
    return WeightBits(
        name="gguf:" + "+".join(types),
        linear=linear,
        experts=bits("experts", linear),
        embedding=bits("embedding", linear),
        lm_head=bits("lm_head", bits("embedding", linear)),
        small=bits("small", 32.0),
        # what the engine runs a GGUF file with by default on a CPU (gguf-a16: int16
        # activations); hardware without an int16 peak holds it against bf16's
        compute_dtype="int16",
    )


def gguf_tensor_totals(reader) -> tuple[int, int]:
    """(parameter count, tensor bytes) summed over a GGUF file's tensors."""
    return (sum(int(t.n_elements) for t in reader.tensors),
            sum(int(t.n_bytes) for t in reader.tensors))
