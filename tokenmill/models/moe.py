"""Mixture-of-Experts on the shared decoder: Qwen3-MoE and Mixtral.

An MoE model is a Llama-family decoder (models/llama.py) whose sparse layers
swap the dense MLP for `SparseMoeBlock`: a router (one (E, hidden) linear,
softmax, top-k, renormalized as each family does) and `Experts`, every
expert's weights stacked into one tensor per projection:

    w13: (E, 2 * I, hidden)  rows [0, I) gate_proj, [I, 2I) up_proj
    w2:  (E, hidden, I)      down_proj

Checkpoints name experts one tensor each (transformers' `mlp.experts.N.gate_proj`,
Mixtral's `block_sparse_moe.experts.N.w1/w3/w2`) or stacked (GGUF's
`ffn_{gate,up,down}_exps`, transformers 5's fused `mlp.experts.gate_up_proj`);
`checkpoint_param` routes each into its rows of the stack.

Compute reads only what is routed (`moe_compute.py`): the step's (token, expert)
pairs are sorted by expert and each active expert's weights are used once, for
all the tokens routed to it; experts nobody chose are not touched.

Tensor parallelism splits every expert's intermediate dimension I over the
ranks, as vLLM's TP does: each rank holds rows of w13 and columns of w2 of all
E experts, the router is replicated, and the block ends in one all-reduce,
like the dense MLP. Expert parallelism (whole experts per rank, tokens sent to
the rank that holds their expert with an all-to-all) is the next step for
large E and is not built.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.distributed.parallel_state import get_tp
from tokenmill.models.layers import Linear, default_weight_loader
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.moe_compute import ExpertTraffic, grouped_experts, route

# checkpoint projection name -> (stack, part)
_PROJECTIONS = {"gate_proj": ("w13", "gate"), "w1": ("w13", "gate"),
                "up_proj": ("w13", "up"), "w3": ("w13", "up"),
                "gate_up_proj": ("w13", "gate_up"),
                "down_proj": ("w2", "down"), "w2": ("w2", "down")}
_EXPERT_NAME = re.compile(
    r"(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?:(?P<expert>\d+)\.)?"
    r"(?P<proj>gate_proj|up_proj|gate_up_proj|down_proj|w1|w2|w3)(?:\.weight)?")
_ROUTER_NAME = re.compile(r"(?P<layer>.+)\.block_sparse_moe\.gate\.weight")


class StackedExpertWeight(nn.Module):
    """One projection of all E experts as a (E, rows, cols) weight, filled per expert or
    whole, each shard (expert, part) accounted for so a missing expert is a load error.

    `parts`: part name -> (first row in this rank's stack, rows); `split_dim` is the
    per-expert dimension split over tensor-parallel ranks (0: rows, w13; 1: columns, w2)."""

    def __init__(self, num_experts: int, rows: int, cols: int, parts: dict[str, tuple[int, int]],
                 split_dim: int, split_start: int, split_len: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, rows, cols), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.parts = parts
        self.split_dim, self.split_start, self.split_len = split_dim, split_start, split_len
        self.shard_offsets = {(e, p): None for e in range(num_experts) for p in parts}
        self.pending: list[tuple[tuple[int | None, str], Callable[[], torch.Tensor]]] = []

    def shard_cover(self, shard_id: tuple[int | None, str]) -> set[tuple[int, str]]:
        """The (expert, part) shards one checkpoint tensor fills."""
        expert, part = shard_id
        experts = range(self.num_experts) if expert is None else [expert]
        parts = ["gate", "up"] if part == "gate_up" else [part]
        return {(e, p) for e in experts for p in parts}

    def checkpoint_slice(self, shard_id: tuple[int | None, str], param_kind: str
                         ) -> tuple[int, int, int] | None:
        """This rank's slice of the expert dimension that tensor parallelism splits."""
        expert, part = shard_id
        if get_tp().world_size == 1 or part == "gate_up":  # gate_up: cut in the loader
            return None
        return (self.split_dim + (expert is None), self.split_start, self.split_len)

    def stacked_rows(self, shard_id: tuple[int | None, str]) -> int | None:
        """First row in each expert's stack of a checkpoint tensor holding one part of all
        E experts (a GGUF `ffn_*_exps`), whose blocks the loader keeps; None for others."""
        expert, part = shard_id
        return self.parts[part][0] if expert is None and part in self.parts else None

    def defer(self, shard_id: tuple[int | None, str], shape: tuple[int, ...],
              load: Callable[[], torch.Tensor]) -> None:
        """Fill this shard from `load()` on first use (`materialize`), not now: a GGUF's
        quantized experts usually run in their records and never need the float stack
        (the loader keeps their blocks; quant/moe_experts.py)."""
        _, part = shard_id
        want = (self.num_experts, self.parts[part][1], self.weight.shape[2])
        if tuple(shape) != want:
            raise ValueError(f"stacked experts of shape {tuple(shape)}, the model has "
                             f"{want}")
        self.pending.append((shard_id, load))

    def materialize(self) -> None:
        """Write the deferred shards into the float stack."""
        with torch.no_grad():
            for shard_id, load in self.pending:
                self.weight_loader(self.weight, load(), shard_id)
        self.pending.clear()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int | None, str]) -> None:
        expert, part = shard_id
        if part == "gate_up":  # (.., 2 * I_full, cols): this rank's gate rows and up rows
            full = loaded.shape[-2] // 2
            if get_tp().world_size > 1:
                s, n = self.split_start, self.split_len
                loaded = torch.cat((loaded[..., s:s + n, :], loaded[..., full + s:full + s + n, :]),
                                   dim=-2)
            start, rows = 0, self.weight.shape[1]
        else:
            start, rows = self.parts[part]
        target = param.narrow(1, start, rows)
        if expert is None:
            if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
                raise ValueError(f"stacked experts of shape {tuple(loaded.shape)}, the model "
                                 f"has {self.num_experts} experts of {tuple(target.shape[1:])}")
            default_weight_loader(target, loaded)  # type: ignore[arg-type]
        else:
            if not 0 <= expert < self.num_experts:
                raise ValueError(f"expert {expert}: the model has {self.num_experts} experts")
            default_weight_loader(target[expert], loaded)  # type: ignore[arg-type]


class Experts(nn.Module):
    """E experts' SwiGLU MLPs: w13 (E, 2 * I_rank, hidden) and w2 (E, hidden, I_rank)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        start, inter = get_tp().shard(intermediate, "moe_intermediate_size")
        self.num_experts, self.intermediate = num_experts, inter
        self.traffic = ExpertTraffic()  # this rank's reads (CPU path)
        self.w13 = StackedExpertWeight(num_experts, 2 * inter, hidden,
                                       {"gate": (0, inter), "up": (inter, inter)}, 0, start, inter)
        self.w2 = StackedExpertWeight(num_experts, hidden, inter, {"down": (0, hidden)},
                                      1, start, inter)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x (T, hidden), routing weights and expert ids (T, k) -> (T, hidden), this rank's
        partial sum under tensor parallelism."""
        if self.w13.pending or self.w2.pending:  # a GGUF's experts, first run in float
            self.w13.materialize()
            self.w2.materialize()
        return grouped_experts(x, self.w13.weight, self.w2.weight, weights, ids, self.traffic)


class SparseMoeBlock(nn.Module):
    """Router + routed experts in place of a dense MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; tokenmill runs silu")
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts)  # replicated on every rank
        self.experts = Experts(config.num_experts, config.hidden_size,
                               config.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.norm_topk_prob)  # (T, k) each
        return get_tp().all_reduce(self.experts(x, weights, ids))


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3MoeForCausalLM and MixtralForCausalLM: the shared decoder, its sparse layers'
    MLPs replaced by `SparseMoeBlock` (Qwen3-MoE may keep some layers dense)."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = \
        LlamaForCausalLM.packed_modules_mapping
    is_moe = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            if config.is_sparse_layer(i):
                layer.mlp = SparseMoeBlock(config)

    def checkpoint_param(self, name: str) -> tuple[str, Any] | None:
        """(parameter name, shard id) of an expert or router tensor; None for the others,
        which load as the dense decoder's do."""
        m = _EXPERT_NAME.fullmatch(name)
        if m:
            stack, part = _PROJECTIONS[m["proj"]]
            expert = None if m["expert"] is None else int(m["expert"])
            return f"{m['layer']}.mlp.experts.{stack}.weight", (expert, part)
        m = _ROUTER_NAME.fullmatch(name)
        if m:
            return f"{m['layer']}.mlp.gate.weight", None
        return None


def expert_bytes_read(model: nn.Module) -> int:
    """Routed-expert weight bytes this rank's MoE layers have read so far (CPU path;
    0 for a dense model): the measured side of the active-expert floor."""
    # float Experts and the GGUF records' experts (quant/moe_experts.py) count alike
    traffic = [m.traffic for m in model.modules()
               if isinstance(getattr(m, "traffic", None), ExpertTraffic)]
    for t in traffic:
        t.fold()  # the fused decode step's counts
    return sum(t.bytes_read for t in traffic)
