"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding and
linears whose parameters know how to load checkpoint tensors into themselves.

Parameters are created with `torch.empty`: the loader overwrites every one of
them, so random initialisation would only waste time.

With bf16 activations on the CPU, RMSNorm (with its residual add), rotary and
SiLU * up each run as one fused native call (tokenmill/kernels/layer_ops.c)
where it is built; the torch ops below are the fallback and the fp32 path.

Each parameter carries `weight_loader(param, loaded_weight, shard_id)`. Fused
linears (`FusedLinear`: q / k / v, or gate / up) copy a checkpoint shard into
its rows of the fused weight. The tensor-parallel versions the model builds
are in parallel_layers.py.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import bf16_gemv, layer_ops


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor,
                          shard_id: Any = None) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, "
                         f"checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def _param(*shape: int) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return p


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = layer_ops.rms_norm(x, self.weight, self.eps)  # bf16 on CPU: one fused call
        if out is not None:
            return out
        # normalise in float32 and scale in the input dtype, as Hugging Face does
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream's next value r = x + residual (x itself when residual is
        None) and norm(r). The fused kernel updates `residual` in place and writes the
        norm over x, both fresh activations of this step."""
        if residual is None:
            return self(x), x
        out = layer_ops.rms_norm(x, self.weight, self.eps, residual)
        if out is not None:
            return out, residual
        residual = x + residual
        return self(residual), residual

    def add_forward_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                           linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(r)), r) with r as add_forward's: for a CUDA decode batch one
        kernel where `linear` is a plain Linear (triton_decode_linear), which writes r
        to a fresh tensor; otherwise add_forward, then the linear."""
        ops = layer_ops.decode_linears(x)
        if ops is not None and type(self) is RMSNorm and plain_linear(linear) and x.dim() == 2:
            done = ops.norm_linear(x, residual, self.weight, self.eps, linear.weight,
                                   linear.bias)
            if done is not None:
                return done
        h, residual = self.add_forward(x, residual)
        return linear(h), residual


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = _param(num_embeddings, embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class Linear(nn.Module):
    """y = x W^T (+ b). Quantized replacements swap this module out from outside."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":  # a decode step's bf16 rows (up to 48): one read of the weight
            y = bf16_gemv.linear(x, self.weight, self.bias)
            if y is not None:
                return y
        ops = layer_ops.decode_linears(x)  # None but for CUDA tensors
        if ops is not None and x.dim() == 2:
            y = ops.linear(x, self.weight, self.bias)  # a CUDA decode batch: no split-K
            if y is not None:
                return y
        return F.linear(x, self.weight, self.bias)

    def shard_rows(self, shard_id: Any) -> tuple[int, int]:
        """(first row, number of rows) of the fused weight that `shard_id` fills."""
        return 0, self.out_features

    def checkpoint_slice(self, shard_id: Any, param_kind: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of the checkpoint tensor this rank reads; None: all of it."""
        return None


class FusedLinear(Linear):
    """A linear whose output rows are the concatenation of several checkpoint tensors."""

    def __init__(self, in_features: int, shard_sizes: dict[Any, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[Any, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for p in self.parameters():
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def shard_rows(self, shard_id: Any) -> tuple[int, int]:
        return self.shard_offsets[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any) -> None:
        start, size = self.shard_offsets[shard_id]
        default_weight_loader(param.narrow(0, start, size), loaded_weight)  # type: ignore[arg-type]


def plain_linear(module: nn.Module) -> bool:
    """A Linear that runs Linear.forward: not a quantized or LoRA replacement, no hooks
    (the fused kernels read its weight and bias themselves)."""
    return (isinstance(module, Linear) and type(module).forward is Linear.forward
            and not module._forward_hooks and not module._forward_pre_hooks)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    out = layer_ops.silu_mul(gate_up)  # bf16 on CPU: one fused call
    if out is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_linear(gate_up: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """linear(silu(gate) * up): for a CUDA decode batch one kernel where `linear` is a
    plain Linear (triton_decode_linear), else the two steps."""
    ops = layer_ops.decode_linears(gate_up)
    if ops is not None and plain_linear(linear) and gate_up.dim() == 2:
        y = ops.silu_mul_linear(gate_up, linear.weight, linear.bias)
        if y is not None:
            return y
    return linear(silu_and_mul(gate_up))


MAX_ROTARY_POSITIONS = 1 << 17  # caps the cos/sin table at 64 MiB for head_dim 128


def rope_inv_freq(head_dim: int, base: float,
                  rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) float32, with Llama 3 / linear scaling applied."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type") or (rope_scaling or {}).get("type")
    if rope_type in (None, "default"):
        return inv_freq
    assert rope_scaling is not None
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        factor = rope_scaling["factor"]
        low_freq_factor = rope_scaling.get("low_freq_factor", 1.0)
        high_freq_factor = rope_scaling.get("high_freq_factor", 4.0)
        old_context_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope_type == "gguf_freq_factors":
        # llama.cpp stores Llama 3 scaling as per-frequency divisors (tensor rope_freqs)
        return inv_freq / torch.tensor(rope_scaling["freq_factors"], dtype=torch.float32)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}; tokenmill supports "
                     "default, linear and llama3")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), with a precomputed cos/sin table.

    Every layer rotates at the same positions, so the per-step gather of the
    table is done once and reused while the same `positions` tensor comes back.
    """

    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, base, rope_scaling)
        t = torch.arange(min(max_position, MAX_ROTARY_POSITIONS), dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (max_position, head_dim // 2)
        # x * cos + rotate_half(x) * sin, with rotate_half(x) = roll(x) and its sign in sin
        self.register_buffer("cos_cache", torch.cat((freqs.cos(), freqs.cos()), -1),
                             persistent=False)  # (max_position, head_dim)
        self.register_buffer("sin_cache", torch.cat((-freqs.sin(), freqs.sin()), -1),
                             persistent=False)
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._step is None or self._step[0] is not positions:
            cos = self.cos_cache[positions].unsqueeze(1)  # (T, 1, head_dim)
            sin = self.sin_cache[positions].unsqueeze(1)
            self._step = (positions, cos, sin)
        return self._step[1], self._step[2]

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, head_dim) -> rotated, same dtype (math in float32). A bf16 x
        on the CPU is rotated in place by one fused call."""
        if layer_ops.rotary_(x, positions, self.cos_cache, self.sin_cache):
            return x
        cos, sin = self._cos_sin(positions)
        x32 = x.float()
        half = x32.shape[-1] // 2
        return (x32 * cos + x32.roll(half, dims=-1) * sin).to(x.dtype)
