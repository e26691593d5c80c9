"""Gemma 3 (text): the shared decoder's linears, attention core and norms, with
Gemma's differences.

- Local layers attend to the last `sliding_window` tokens only (key k visible to
  query q iff 0 <= q - k < W) with RoPE base `rope_local_theta` (10k); every
  `full_attention` layer (every 6th) sees the whole context with base
  `rope_theta` (1M) and, on 4B and larger, linear RoPE scaling.
- RMSNorm scales by (1 + w): the loader adds the 1 once (GemmaRMSNorm), so the
  shared RMSNorm and its fused kernel run unchanged. A GGUF file stores 1 + w
  already; loaders/gguf.py subtracts it, so both sources arrive as w.
- Four norms per layer: before and after attention, before and after the MLP.
- q and k are RMS-normalised per head (QK-norm) before RoPE; queries scaled by
  query_pre_attn_scalar ** -0.5 (not head_dim: they differ on 27B).
- GeGLU MLP: gelu_pytorch_tanh(gate) * up.
- The embedding is multiplied by sqrt(hidden_size) (rounded to the weights' dtype,
  as transformers does); the LM head is tied to the embedding.

A Gemma3ForConditionalGeneration checkpoint runs its language model only: the
vision tower's tensors are skipped at load (`checkpoint_name`), and the server
refuses image inputs by name.

Kernel paths (tokenmill/engine/runner/fused_decode.py, quant/, attention/): decode
steps run the native fused decode step (kernels/decode_step.c), which knows these
differences (its record's q/k norms, output norms, per-layer rotary tables and
windows, GeGLU); the batched/quantized linears and the prompt attention kernels
serve every layer as they do Llama's (the CPU backend's window handling is in
attention/window.py). On a bf16 CPU run the GeGLU is layer_ops' native row, the
fused step's own.
"""

from __future__ import annotations

import logging
import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.distributed.parallel_state import get_tp
from tokenmill.kernels import layer_ops
from tokenmill.models.attention import Attention
from tokenmill.models.layers import RMSNorm, RotaryEmbedding, default_weight_loader
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

logger = logging.getLogger(__name__)

_GELU_APPROXIMATE = {"gelu_pytorch_tanh": "tanh", "gelu_tanh": "tanh", "gelu": "none",
                     "gelu_new": "tanh"}


def _plus_one_loader(param: nn.Parameter, loaded_weight: torch.Tensor,
                     shard_id: object = None) -> None:
    default_weight_loader(param, loaded_weight.float() + 1.0)


class GemmaRMSNorm(RMSNorm):
    """Gemma's x / rms(x) * (1 + w), held as the shared RMSNorm of weight 1 + w."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = _plus_one_loader  # type: ignore[attr-defined]


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding,
                 sliding_window: int | None) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          config.num_attention_heads,
                                          config.num_key_value_heads, bias=False)
        self.num_heads = self.qkv_proj.num_heads  # this rank's heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=False,
                                        what="num_attention_heads * head_dim")
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary  # the local or the global table, shared by those layers
        scalar = config.query_pre_attn_scalar or self.head_dim
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=scalar ** -0.5, sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, q_size + 2 * kv_size)
        q = qkv[:, : self.q_size].unflatten(-1, (self.num_heads, self.head_dim))
        k = qkv[:, self.q_size: self.q_size + self.kv_size].unflatten(
            -1, (self.num_kv_heads, self.head_dim))
        v = qkv[:, self.q_size + self.kv_size:].unflatten(-1, (self.num_kv_heads, self.head_dim))
        # contiguous heads: the native norm's rows at any T (the fused decode step's bits)
        qk = torch.cat((self.q_norm(q.contiguous()), self.k_norm(k.contiguous())), dim=1)
        q, k = self.rotary.rotate(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.o_proj(self.attn(q, k, v))
        return get_tp().all_reduce(out)  # (T, hidden)


class Gemma3MLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate) * up). Not a LlamaMLP, so quant/model.py does not
    fuse SiLU into its down projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act not in _GELU_APPROXIMATE:
            raise ValueError(f"unsupported hidden_activation {config.hidden_act!r} for "
                             f"Gemma 3; tokenmill runs {', '.join(_GELU_APPROXIMATE)}")
        self.approximate = _GELU_APPROXIMATE[config.hidden_act]
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size,
                                                       [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           what="intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        # bf16 on the CPU: one native pass whose rows the fused decode step shares
        act = layer_ops.gelu_tanh_mul(gate_up) if self.approximate == "tanh" else None
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate=self.approximate) * up
        return get_tp().all_reduce(self.down_proj(act))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding,
                 sliding_window: int | None) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = Gemma3Attention(config, rotary, sliding_window)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: returns this layer's output and the residual stream
        before it, added together by the next norm."""
        x, residual = self.input_layernorm.add_forward(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm.add_forward(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = math.sqrt(config.hidden_size)
        max_pos = config.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_pos, config.rope_theta,
                                          config.rope_scaling)
        self.rotary_emb_local = RotaryEmbedding(config.head_dim, max_pos,
                                                config.rope_local_theta or 10_000.0)
        layers = []
        for i in range(config.num_hidden_layers):
            window = config.layer_window(i)
            rotary = self.rotary_emb if window is None else self.rotary_emb_local
            layers.append(Gemma3DecoderLayer(config, rotary, window))
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, hidden)
        # transformers rounds sqrt(hidden) to the weights' dtype first (25.25 in bf16)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm.add_forward(x, residual)[0]


class Gemma3ForCausalLM(nn.Module):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = \
        LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.layer_types is None:
            raise ValueError("a Gemma 3 config needs layer_types (config_gemma3.py)")
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.softcap = config.final_logit_softcapping
        n_global = config.layer_types.count("full_attention")
        logger.info("gemma3: %d layers, %d global and %d sliding (window %d)",
                    config.num_hidden_layers, n_global,
                    config.num_hidden_layers - n_global, config.sliding_window or 0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: (T,) -> hidden states (T, hidden_size)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden_size) -> logits (N, vocab_size) float32."""
        head = self.lm_head
        logits = head.forward_fp32(hidden) if hasattr(head, "forward_fp32") else \
            head(hidden).float()
        logits = get_tp().gather_last_dim(logits)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A checkpoint tensor's name in this module, None to skip it: a
        Gemma3ForConditionalGeneration's language model sits under
        `model.language_model.` (transformers 5) or `language_model.model.`, its
        vision tower and projector are not loaded."""
        for prefix, to in (("model.language_model.", "model."),
                           ("language_model.model.", "model."),
                           ("language_model.lm_head.", "lm_head.")):
            if name.startswith(prefix):
                return to + name[len(prefix):]
        if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                            "model.multi_modal_projector.")):
            return None
        return name
