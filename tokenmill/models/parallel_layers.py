"""Linears and embeddings split over the tensor-parallel ranks (Megatron's layout).

Column-parallel (q/k/v, gate/up): each rank holds a slice of the output rows,
so each computes its own heads or its own slice of the MLP, no communication.
Row-parallel (o_proj, down_proj): each rank holds the matching slice of the
input columns and computes a partial sum; the model adds the partial sums with
one all-reduce per row-parallel linear (in llama.py, on the linear's output,
so that a quantized linear swapped in by tokenmill.quant keeps it).
Vocab-parallel embedding and LM head: each rank holds a slice of the
vocabulary; the embedding all-reduces its (mostly zero) rows once per step,
the logits are gathered on rank 0 once per step.

Every layer says which slice of a checkpoint tensor it needs
(`checkpoint_slice`), and the loader reads only that slice from safetensors
or GGUF. With a world of one every slice is the whole tensor.

KV heads are split like query heads; with fewer KV heads than ranks each rank
holds the one KV head its query heads use (replicated over tp / num_kv_heads
ranks), as vLLM does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import ParallelState, get_tp
from tokenmill.models.layers import Embedding, FusedLinear, Linear, default_weight_loader


class ColumnParallelLinear(Linear):
    """Rank r holds output rows [r * n, (r + 1) * n) of the checkpoint's (out, in) weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 what: str = "out_features") -> None:
        row_start, rows = get_tp().shard(out_features, what)
        super().__init__(in_features, rows, bias)
        self.row_start = row_start

    def checkpoint_slice(self, shard_id: Any, param_kind: str) -> tuple[int, int, int] | None:
        return None if get_tp().world_size == 1 else (0, self.row_start, self.out_features)


class RowParallelLinear(Linear):
    """Rank r holds input columns [r * k, (r + 1) * k); its output is a partial sum that
    the caller all-reduces. The bias is added once: rank 0 holds it, the others zeros."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 what: str = "in_features") -> None:
        col_start, cols = get_tp().shard(in_features, what)
        super().__init__(cols, out_features, bias)
        self.col_start = col_start
        if self.bias is not None:
            self.bias.weight_loader = _rank0_only  # type: ignore[attr-defined]

    def checkpoint_slice(self, shard_id: Any, param_kind: str) -> tuple[int, int, int] | None:
        if get_tp().world_size == 1 or param_kind != "weight":
            return None
        return 1, self.col_start, self.in_features


def _rank0_only(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    if get_tp().rank == 0:
        default_weight_loader(param, loaded_weight)
    else:
        param.data.zero_()


# the shard id of a checkpoint tensor that is already fused (Phi-3's qkv_proj and
# gate_up_proj): all the parts, each whole, in the fused layer's order
FUSED = "fused"


class _ColumnParallelFused(FusedLinear):
    """Several checkpoint tensors as one column-parallel matmul: for each shard id,
    (first row, rows) of the checkpoint tensor this rank reads, and that tensor's rows
    in all (`full_rows`: where each part starts in an already fused checkpoint tensor)."""

    def __init__(self, in_features: int, checkpoint_rows: dict[Any, tuple[int, int]],
                 bias: bool, full_rows: dict[Any, int]) -> None:
        super().__init__(in_features, {k: n for k, (_, n) in checkpoint_rows.items()}, bias)
        self.checkpoint_rows = checkpoint_rows
        self.full_rows = full_rows

    def checkpoint_slice(self, shard_id: Any, param_kind: str) -> tuple[int, int, int] | None:
        if get_tp().world_size == 1 or shard_id == FUSED:
            return None  # a fused tensor is read whole; weight_loader takes this rank's rows
        start, rows = self.checkpoint_rows[shard_id]
        return 0, start, rows

    def shard_cover(self, shard_id: Any) -> set[Any]:
        """The shards one checkpoint tensor fills (model_loader checks all are loaded)."""
        return set(self.shard_offsets) if shard_id == FUSED else {shard_id}

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any) -> None:
        if shard_id != FUSED:
            return super().weight_loader(param, loaded_weight, shard_id)
        total = sum(self.full_rows.values())
        if loaded_weight.shape[0] != total:
            raise ValueError(f"a fused tensor of {loaded_weight.shape[0]} rows; the parts "
                             f"{dict(self.full_rows)} need {total}")
        offset = 0
        for part, full in self.full_rows.items():
            start, rows = self.checkpoint_rows[part]
            super().weight_loader(param, loaded_weight[offset + start: offset + start + rows],
                                  part)
            offset += full


class QKVParallelLinear(_ColumnParallelFused):
    """q_proj, k_proj and v_proj as one matmul over this rank's heads; output [q | k | v]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool) -> None:
        tp = get_tp()
        q_start, q_heads = tp.shard(num_heads, "num_attention_heads")
        kv_start, kv_heads = kv_head_shard(num_kv_heads, tp)
        super().__init__(hidden_size, {"q": (q_start * head_dim, q_heads * head_dim),
                                       "k": (kv_start * head_dim, kv_heads * head_dim),
                                       "v": (kv_start * head_dim, kv_heads * head_dim)}, bias,
                         {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                          "v": num_kv_heads * head_dim})
        self.num_heads, self.num_kv_heads = q_heads, kv_heads  # this rank's


class MergedColumnParallelLinear(_ColumnParallelFused):
    """Several linears on the same input as one matmul (gate_proj and up_proj: shards 0, 1),
    each split over the ranks."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 what: str = "intermediate_size") -> None:
        tp = get_tp()
        super().__init__(in_features, {i: tp.shard(n, what) for i, n in enumerate(out_sizes)},
                         bias, dict(enumerate(out_sizes)))


def kv_head_shard(num_kv_heads: int, tp: ParallelState) -> tuple[int, int]:
    """(first KV head, KV heads) of this rank: an equal slice, or with fewer KV heads than
    ranks the one KV head this rank's query heads attend with."""
    if num_kv_heads >= tp.world_size:
        return tp.shard(num_kv_heads, "num_key_value_heads")
    if tp.world_size % num_kv_heads:
        raise ValueError(f"the tensor-parallel size ({tp.world_size}) must be a multiple of "
                         f"num_key_value_heads ({num_kv_heads}) when it is larger")
    return tp.rank * num_kv_heads // tp.world_size, 1


class VocabParallelEmbedding(Embedding):
    """Rank r holds the embeddings of tokens [r * n, (r + 1) * n); other tokens give zero
    rows here, and one all-reduce per step fills them in from the rank that has them."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        vocab_start, rows = get_tp().shard(num_embeddings, "vocab_size")
        super().__init__(rows, embedding_dim)
        self.vocab_start = vocab_start

    def checkpoint_slice(self, shard_id: Any, param_kind: str) -> tuple[int, int, int] | None:
        tp = get_tp()
        return None if tp.world_size == 1 else (0, self.vocab_start, self.weight.shape[0])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        tp = get_tp()
        if tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start  # (T,)
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (T, hidden)
        return tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(ColumnParallelLinear):
    """The LM head over this rank's vocabulary slice (the same rows as the embedding's,
    so a tied head shares its shard); the model gathers the logits on rank 0."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, what="vocab_size")
