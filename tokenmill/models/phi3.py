"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): the Llama decoder with three differences.

- The checkpoint fuses q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`) already; they
  load whole into the same fused linears (shard `FUSED`, parallel_layers.py), each
  tensor-parallel rank taking its rows of every part.
- LongRoPE (`rope_scaling` longrope / su): per-frequency divisors `short_factor` while
  the sequence is at most `original_max_position_embeddings` long, `long_factor` past
  it, and cos/sin scaled by sqrt(1 + ln(s) / ln(original)) with s = max_position /
  original (or the config's `attention_factor`). The switch is transformers' rule
  (modeling_rope_utils.longrope_frequency_update: long iff the forward's largest
  position + 1 > original), applied per sequence of the flat batch: a sequence's new
  tokens in a step rotate with the long factors iff its length after the step passes
  the original context. Keys already cached keep the factors they were written with,
  as they do in transformers' generate with a KV cache. Where that differs from a
  one-pass transformers forward: a prompt longer than the original context that is
  chunked (its first chunks end before it and rotate short), or a prefix-cache hit
  on blocks written by a shorter sequence (docs/models.md says so).
- Phi-4-mini's `partial_rotary_factor` (0.75): RoPE on the first 75% of each head's
  dims, the rest pass through.
- Phi-3-mini-4k's `sliding_window` (2047) on every layer: key k visible to query q
  iff 0 <= q - k < W, transformers' mask (attention/window.py in every backend).

Decode runs the module path: the native fused step (engine/runner/fused_decode.py)
takes plain LlamaForCausalLM only.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.attention.metadata import get_attention_metadata
from tokenmill.config import ModelConfig
from tokenmill.kernels import layer_ops
from tokenmill.models.layers import MAX_ROTARY_POSITIONS
from tokenmill.models.llama import LlamaForCausalLM, LlamaModel
from tokenmill.models.parallel_layers import FUSED, ParallelLMHead

logger = logging.getLogger(__name__)


def _tables(inv_freq: torch.Tensor, positions: int, scale: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox cos/sin tables (positions, 2 * len(inv_freq)), the sign of rotate_half in sin."""
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


class Phi3RotaryEmbedding(nn.Module):
    """RoPE on the first `rotary_dim` dims, with LongRoPE's short and long tables.

    One table holds both: rows [0, original) short, rows [original, original + P) long,
    so a step's rotation is one gather at `positions + original * long`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.rotary_dim = int(head_dim * config.partial_rotary_factor)
        dims = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
        inv_freq = 1.0 / (config.rope_theta ** dims)
        positions = min(config.max_position_embeddings, MAX_ROTARY_POSITIONS)
        scaling = config.rope_scaling
        self.original: int | None = None
        if scaling is None:
            cos, sin = _tables(inv_freq, positions, 1.0)
        else:
            self.original = original = scaling["original_max_position_embeddings"]
            factor = scaling.get("factor") or config.max_position_embeddings / original
            attention = scaling.get("attention_factor")
            if attention is None:  # transformers' default: the LongRoPE paper's
                attention = 1.0 if factor <= 1.0 else \
                    math.sqrt(1 + math.log(factor) / math.log(original))
            short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
            long = torch.tensor(scaling["long_factor"], dtype=torch.float32)
            short_cos, short_sin = _tables(inv_freq / short, original, attention)
            long_cos, long_sin = _tables(inv_freq / long, positions, attention)
            cos, sin = torch.cat((short_cos, long_cos)), torch.cat((short_sin, long_sin))
        self.register_buffer("cos_cache", cos.contiguous(), persistent=False)
        self.register_buffer("sin_cache", sin.contiguous(), persistent=False)
        self._step: tuple[Any, Any, torch.Tensor] | None = None

    def _rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The table row of each token: its position, plus `original` where long."""
        original = self.original
        if original is None:
            return positions
        meta = get_attention_metadata()
        if meta is None:  # one causal sequence: transformers' rule as it is
            long = (positions.max() + 1 > original).expand(positions.shape)
        elif meta.is_decode_only:  # one token per sequence, its length = position + 1
            long = positions >= original
        else:
            if self._step is not None and self._step[0] is positions and self._step[1] is meta:
                return self._step[2]
            lens = torch.repeat_interleave(torch.tensor(meta.seq_lens_list),
                                           torch.tensor(meta.query_lens_list))
            if lens.numel() != positions.numel():  # padded rows: each by its own position
                lens = torch.cat((lens, positions[lens.numel():].cpu() + 1))
            long = lens.to(positions.device) > original
            rows = positions + long.to(positions.dtype) * original
            self._step = (positions, meta, rows)
            return rows
        return positions + long.to(positions.dtype) * original

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, head_dim) -> rotated on its first rotary_dim dims (math in fp32)."""
        rows = self._rows(positions)
        if self.rotary_dim == x.shape[-1]:
            if layer_ops.rotary_(x, rows.contiguous(), self.cos_cache, self.sin_cache):
                return x  # bf16 on the CPU: in place, one fused call
            return self._rotate(rows, x)
        rot = self._rotate(rows, x[..., : self.rotary_dim])
        return torch.cat((rot, x[..., self.rotary_dim:]), dim=-1)

    def _rotate(self, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos = self.cos_cache[rows].unsqueeze(1)  # (T, 1, rotary_dim)
        sin = self.sin_cache[rows].unsqueeze(1)
        x32 = x.float()
        return (x32 * cos + x32.roll(x32.shape[-1] // 2, dims=-1) * sin).to(x.dtype)


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = \
        LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = LlamaModel(config, Phi3RotaryEmbedding(config), config.sliding_window)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        rope = config.rope_scaling
        logger.info("phi3: rotary on %d of %d head dims, %s, sliding window %s; decode runs "
                    "the module path (the native fused step takes plain Llama layers)",
                    self.model.rotary_emb.rotary_dim, config.head_dim,
                    f"LongRoPE (original context {rope['original_max_position_embeddings']})"
                    if rope else "no RoPE scaling", config.sliding_window or "none")

    @staticmethod
    def checkpoint_param(name: str) -> tuple[str, Any] | None:
        """The checkpoint's fused qkv_proj / gate_up_proj: the whole tensor into the fused
        linear (every shard at once); other tensors by their own names."""
        if name.endswith((".qkv_proj.weight", ".gate_up_proj.weight")):
            return name, FUSED
        return None
