"""Routing and the routed experts' math, reading only the experts a step chose.

`route`: softmax over the E router logits in float32, top-k, renormalized to sum
to 1 when the family does (Mixtral always; Qwen3-MoE with norm_topk_prob).

`grouped_experts`: the step's T * k (token, expert) pairs sorted by expert; each
active expert's w13 and w2 are then used once for all the tokens routed to it
(a GEMV at decode's few rows, a GEMM in a prefill chunk), so a decode step moves
the union of the chosen experts' bytes and nothing of the others. On the GPU
the same grouping runs as one Triton launch per projection
(kernels/triton_moe.py).

`grouped` is the grouping alone, over any per-expert MLP: the float experts here
(`grouped_experts`) and a GGUF file's experts kept in their quantized-activation
kernel records (tokenmill/quant/moe_experts.py), one native call per active expert
and projection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.kernels import bf16_gemv
from tokenmill.models.layers import silu_and_mul


def route(logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) -> (weights (T, k) float32, expert ids (T, k) int64)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":  # bf16 rows: one streamed read of this expert's weight
        y = bf16_gemv.linear(x, weight)
        if y is not None:
            return y
    return F.linear(x, weight)


def sort_by_expert(ids: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (T, k) -> (order: the flat (token, slot) indices sorted by expert (T * k,),
    counts: tokens per expert (E,))."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts)


@dataclass
class ExpertTraffic:
    """What the routed experts of one layer read, counted on the CPU path (the GPU path
    would need a host sync per layer to count): tokens routed and expert weight bytes."""

    tokens: int = 0
    expert_reads: int = 0  # active experts summed over calls
    bytes_read: int = 0
    # the fused decode step's counters (engine/runner/fused_decode.py, kernels/
    # moe_step.h: [e] steps expert e ran in, [E] rows), folded in by `fold`
    native: torch.Tensor | None = None
    native_bytes: Sequence[int] = ()

    def record(self, tokens: int, active: int, bytes_read: int) -> None:
        self.tokens += tokens
        self.expert_reads += active
        self.bytes_read += bytes_read

    def native_counters(self, expert_bytes: Sequence[int]) -> torch.Tensor:
        """(E + 1,) int64 zeros a native step counts this layer's reads into; kept here."""
        if self.native is None:
            self.native = torch.zeros(len(expert_bytes) + 1, dtype=torch.int64)
            self.native_bytes = list(expert_bytes)
        return self.native

    def fold(self) -> None:
        """Add what the native step counted since the last fold to the totals."""
        if self.native is None:
            return
        counts = self.native.tolist()
        self.native.zero_()
        per_expert = counts[:-1]
        self.record(counts[-1], sum(per_expert),
                    sum(n * b for n, b in zip(per_expert, self.native_bytes, strict=True)))


# (expert, x rows routed to it (n, H)) -> that expert's MLP output (n, H)
ExpertMLP = Callable[[int, torch.Tensor], torch.Tensor]


def grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
            expert_mlp: ExpertMLP, expert_bytes: Sequence[int],
            traffic: ExpertTraffic | None = None) -> torch.Tensor:
    """x (T, H); weights, ids (T, k) -> (T, H) in x's dtype: sum over each token's k
    experts of weight * expert_mlp(expert, its rows), each active expert called once for
    all its tokens and the others not at all. `expert_bytes[e]`: what expert e's weights
    occupy (the traffic count)."""
    tokens_n, top_k = ids.shape
    if tokens_n == 1:  # batch-1 decode: the k experts in slot order, no sort
        chosen = ids[0].tolist()  # distinct (top-k)
        if traffic is not None:
            traffic.record(1, top_k, sum(expert_bytes[e] for e in chosen))
        pairs = torch.cat([expert_mlp(e, x) for e in chosen])  # (k, H), row = slot
        return (pairs * weights[0].to(x.dtype).unsqueeze(-1)).sum(dim=0, keepdim=True)
    order, counts = sort_by_expert(ids, num_experts)
    token_of = order // top_k  # (T * k,) the token of each sorted pair
    # each pair's output lands in its own row, then a token's k rows are summed: no
    # scatter-add (slow and order-dependent on the CPU)
    pairs = x.new_empty(tokens_n * top_k, x.shape[1])  # (T * k, H), row t * k + slot
    start = 0
    counts_list = counts.tolist()  # one host sync per layer, not per expert
    if traffic is not None:
        active = [e for e, n in enumerate(counts_list) if n]
        traffic.record(tokens_n, len(active), sum(expert_bytes[e] for e in active))
    for expert, n in enumerate(counts_list):
        if n == 0:
            continue  # not routed this step: its weights are not read
        rows = order[start:start + n]
        pairs[rows] = expert_mlp(expert, x[token_of[start:start + n]])  # (n, H)
        start += n
    weighted = pairs.view(tokens_n, top_k, -1) * weights.to(x.dtype).unsqueeze(-1)
    return weighted.sum(dim=1)  # (T, H)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor,
                    traffic: ExpertTraffic | None = None) -> torch.Tensor:
    """x (T, H); w13 (E, 2I, H); w2 (E, H, I); weights, ids (T, k) -> (T, H) in x's dtype:
    sum over each token's k experts of weight * down(silu(gate(x)) * up(x))."""
    if x.device.type == "cuda":  # one Triton launch per projection, no host sync
        from tokenmill.kernels.triton_moe import fused_moe

        return fused_moe(x, w13, w2, weights, ids)

    def expert_mlp(expert: int, xs: torch.Tensor) -> torch.Tensor:
        return _linear(silu_and_mul(_linear(xs, w13[expert])), w2[expert])  # (n, H)

    num_experts = w13.shape[0]
    return grouped(x, weights, ids, num_experts, expert_mlp,
                   [w13[0].nbytes + w2[0].nbytes] * num_experts, traffic)
