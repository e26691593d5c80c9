"""One decoder for Llama 2/3, SmolLM, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm).

forward takes a flat batch of tokens (T,) and their positions (T,); attention
metadata for the step comes from `tokenmill.attention.metadata`.

Under tensor parallelism (tokenmill/distributed) each rank builds the same
module over its own heads and slices (models/parallel_layers.py); the only
communication is one all-reduce after each row-parallel linear (o_proj and
down_proj: two per layer), one in the vocab-parallel embedding and one gather
of the logits.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.distributed.parallel_state import get_tp
from tokenmill.models.attention import Attention
from tokenmill.models.layers import RMSNorm, RotaryEmbedding, silu_mul_linear
from tokenmill.models.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Llama's attention_bias also covers o_proj; Qwen2's bias is on q/k/v only
        o_bias = config.attention_bias and config.architecture != "Qwen2ForCausalLM"
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=o_bias,
                                        what="num_attention_heads * head_dim")
        if config.qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary  # shared by all layers; registered once on the model
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim ** -0.5, sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The layer from its projection qkv (T, q_size + 2 * kv_size) on: what the
        decoder layer calls when it computed qkv with the norm (add_forward_linear)."""
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].unflatten(-1, (heads, self.head_dim))
        v = qkv[:, self.q_size + self.kv_size:].unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            # contiguous heads: the native norm's rows at any T (the fused step's bits)
            qk = torch.cat((self.q_norm(q.contiguous()), self.k_norm(k.contiguous())), dim=1)
        # q and k rotate together: one set of ops instead of two; with the KV store too
        # where the attention backend has that kernel (triton)
        stored = type(self.rotary) is RotaryEmbedding and self.attn.rotate_and_store(
            positions, qk, v, self.rotary.cos_cache, self.rotary.sin_cache)
        if not stored:
            qk = self.rotary.rotate(positions, qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.o_proj(self.attn(q, k, v, stored))  # q: (T, heads, D), k/v: (T, kv, D)
        return get_tp().all_reduce(out)  # (T, hidden): the ranks' partial sums added


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; tokenmill runs silu")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size,
                                                       [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           what="intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up), all-reduced: from gate_up_proj's output on."""
        return get_tp().all_reduce(silu_mul_linear(gate_up, self.down_proj))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (the embeddings for the first layer, whose
        residual is None); returns this layer's output and the residual stream
        before it, added together by the next norm (one fused op with it)."""
        # each norm and the projection after it: one kernel for a CUDA decode batch
        qkv, residual = self.input_layernorm.add_forward_linear(x, residual,
                                                                self.self_attn.qkv_proj)
        x = self.self_attn.attend(positions, qkv)
        if type(self.mlp) is not LlamaMLP:  # a MoE block or a quantized replacement
            x, residual = self.post_attention_layernorm.add_forward(x, residual)
            return self.mlp(x), residual
        gate_up, residual = self.post_attention_layernorm.add_forward_linear(
            x, residual, self.mlp.gate_up_proj)
        return self.mlp.down(gate_up), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, rotary: nn.Module | None = None,
                 sliding_window: int | None = None) -> None:
        """rotary: any module with RotaryEmbedding's `rotate` (Phi-3's LongRoPE), default
        the plain one; sliding_window: every layer's (Phi-3), default none."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        if rotary is None:
            rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                     config.rope_theta, config.rope_scaling)
        self.rotary_emb = rotary
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary, sliding_window)  # type: ignore[arg-type]
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, hidden)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm.add_forward(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # checkpoint module name -> (fused module name, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: (T,) -> hidden states (T, hidden_size)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden_size) -> logits (N, vocab_size) float32 (on rank 0; the
        other tensor-parallel ranks get a tensor of that shape nobody reads)."""
        head = self.lm_head
        logits = head.forward_fp32(hidden) if hasattr(head, "forward_fp32") else \
            head(hidden).float()
        return get_tp().gather_last_dim(logits)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
