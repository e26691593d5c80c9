"""LoRA on a model's linears: the base linear once for the whole batch, then the
low-rank products grouped by adapter.

`apply_lora(model)` wraps each decoder layer's qkv_proj, o_proj, gate_up_proj and
down_proj (whatever linear sits there: dense or a quantized one swapped in by
tokenmill.quant) in a `LoRALinear`. Fused qkv / gate_up stay fused: an adapter
holds one A/B pair per sub-projection (q, k, v / gate, up), each adding into its
slice of the fused output. Adapters are installed by integer id; a step says
which rows run under which adapter with `lora_batch({id: rows})`, and each
wrapped linear then runs, per adapter, one (rows, in) @ A_cat^T product for all
of its sub-projections and one (rows, sum r) @ B product with every sub-projection's
B in one block-diagonal matrix, added into the output's covered columns with one add_
or index_add_ (rows of other adapters and of the base are untouched). Few torch ops: a
mixed prefill + decode step runs this path for every adapter on every linear, so each
op's fixed cost counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.models.layers import silu_and_mul

# the PEFT module names each wrapped linear serves, in its output order
SUB_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
TARGET_MODULES = tuple(m for subs in SUB_PROJECTIONS.values() for m in subs)

# this step's rows per adapter id (0, the base, is never listed); None: no adapter
_groups: dict[int, torch.Tensor] | None = None
# adapter id -> its first row, for the adapters whose rows are consecutive (one slice)
_first: dict[int, int] = {}
# bumped whenever any wrapper installs or removes an adapter: a cache of what is installed
# (the fused step's records) is still good while it has not moved
_generation = 0


def installed_generation() -> int:
    """A number that changes whenever an adapter is installed in or removed from any
    LoRALinear."""
    return _generation


@contextlib.contextmanager
def lora_batch(groups: dict[int, torch.Tensor] | None) -> Iterator[None]:
    """Run the model with `groups`: adapter id -> int64 row indices of the flat batch."""
    global _groups, _first
    previous = _groups, _first
    _groups = groups or None
    _first = {i: f for i, rows in (groups or {}).items()
              if (f := _consecutive_from(rows)) is not None}
    try:
        yield
    finally:
        _groups, _first = previous


def _consecutive_from(rows: torch.Tensor) -> int | None:
    """The first row when rows are consecutive and ascending; else None."""
    if not len(rows):
        return None
    first, last = int(rows[0]), int(rows[-1])
    if last - first + 1 != len(rows) or not bool((rows.diff() == 1).all()):
        return None
    return first


@dataclass
class _Weights:
    a_cat: torch.Tensor  # (sum of ranks, in): every sub-projection's A, stacked
    # per sub-projection with weights: (output column start, size, rank slice start,
    # rank, B (size, rank) already multiplied by the scaling)
    parts: list[tuple[int, int, int, int, torch.Tensor]]
    _dense: tuple[torch.Tensor, torch.Tensor, list[int]] | tuple[()] | None = None
    _block: tuple[int, torch.Tensor] | None = None

    def b_block(self) -> tuple[int, torch.Tensor]:
        """(first output column covered, B^T (sum of ranks, columns covered)): every
        sub-projection's scaled B^T in its rank rows and output columns, zero elsewhere,
        so that one product gives the whole delta. The zeros add exactly nothing to a
        sum. Built once."""
        if self._block is None:
            c0 = min(start for start, *_ in self.parts)
            c1 = max(start + size for start, size, *_ in self.parts)
            dtype = self.parts[0][4].dtype
            bt = torch.zeros(self.a_cat.shape[0], c1 - c0, dtype=dtype,
                             device=self.a_cat.device)
            for start, size, r0, r, b in self.parts:
                bt[r0:r0 + r, start - c0:start - c0 + size] = b.t()
            self._block = (c0, bt)
        return self._block

    def native_pair(self, sizes: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
        """(A (R, in) bf16, B bf16 flat, each sub-projection's rank) contiguous, for the
        fused decode step (kernels/lora_delta.h's layouts): A every targeted
        sub-projection's A stacked along the rank, B each targeted sub-projection's
        scaled B in output order as (size / 16, rank / 2, 16, 2) (a group of 16 output
        columns' rank pairs together), an odd rank padded to even with a zero row of A
        and a zero column of B (the same sums); `sizes` the linear's sub-projection sizes
        (a rank 0 where the adapter has none). None when the weights are not bf16 or a
        targeted sub-projection is not whole groups of 16 (the module path). Built once."""
        if self._dense is None:
            self._dense = _pack_native(self, sizes)
        return self._dense or None


def _pack_native(w: _Weights, sizes: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int]] | tuple[()]:
    if w.a_cat.dtype != torch.bfloat16:
        return ()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    by_start = {start: (r0, r, b) for start, _, r0, r, b in w.parts}
    a_rows, b_parts, ranks = [], [], []
    for start, size in zip(starts, sizes):
        if start not in by_start:
            ranks.append(0)
            continue
        r0, r, b = by_start[start]
        if size % 16 or b.dtype != torch.bfloat16:
            return ()
        a = w.a_cat[r0:r0 + r]  # (r, in)
        if r % 2:
            a = torch.cat([a, a.new_zeros(1, a.shape[1])])
            b = torch.cat([b, b.new_zeros(size, 1)], dim=1)
        rank = r + r % 2
        # (size, rank) -> (size / 16, 16, rank / 2, 2) -> (size / 16, rank / 2, 16, 2)
        b_parts.append(b.reshape(size // 16, 16, rank // 2, 2).permute(0, 2, 1, 3).reshape(-1))
        a_rows.append(a)
        ranks.append(rank)
    return torch.cat(a_rows).contiguous(), torch.cat(b_parts).contiguous(), ranks


class LoRALinear(nn.Module):
    """A base linear plus any installed adapters' low-rank deltas on its sub-projections."""

    def __init__(self, base: nn.Module, sizes: list[int], names: tuple[str, ...]) -> None:
        super().__init__()
        self.base = base
        self.sizes = sizes  # output columns of each sub-projection, in order
        self.names = names
        self.adapters: dict[int, _Weights] = {}

    def install(self, lora_id: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
                ) -> None:
        """pairs: sub-projection name -> (A (r, in), B scaled (out_sub, r)); names absent
        from pairs get no delta."""
        starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        a_list, parts, r0 = [], [], 0
        for name, start, size in zip(self.names, starts, self.sizes):
            if name not in pairs:
                continue
            a, b = pairs[name]
            a_list.append(a)
            parts.append((start, size, r0, a.shape[0], b))
            r0 += a.shape[0]
        if parts:
            self.adapters[lora_id] = _Weights(torch.cat(a_list, 0), parts)
        _bump()

    def remove(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)
        _bump()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return y if _groups is None else self._add_deltas(x, y, _groups)

    def silu_mul_forward(self, h: torch.Tensor) -> torch.Tensor:
        """A quantized down_proj's fused silu(gate) * up then down (quant/fused_mlp.py):
        the adapter's delta reads the same activation, computed once more here."""
        y = self.base.silu_mul_forward(h)
        return y if _groups is None else self._add_deltas(silu_and_mul(h), y, _groups)

    def _add_deltas(self, x: torch.Tensor, y: torch.Tensor,
                    groups: dict[int, torch.Tensor]) -> torch.Tensor:
        for lora_id, rows in groups.items():
            w = self.adapters.get(lora_id)
            if w is None:
                continue
            # one index_add_ over the covered columns (serial, a row at a time, 2-3x
            # faster than gather, add, scatter, which also open parallel regions); it
            # was a sub-projection's column slice at a time, 7 a layer, each a cost
            first = _first.get(lora_id)
            xs = x.narrow(0, first, len(rows)) if first is not None \
                else x.index_select(0, rows)
            xa = xs.to(w.a_cat.dtype) @ w.a_cat.t()  # (n, sum r)
            c0, bt = w.b_block()
            delta = (xa @ bt).to(y.dtype)  # (n, columns covered)
            out = y.narrow(1, c0, bt.shape[1])
            if first is not None:
                out.narrow(0, first, len(rows)).add_(delta)
            else:
                out.index_add_(0, rows, delta)
        return y


def _bump() -> None:
    global _generation
    _generation += 1


def apply_lora(model: nn.Module) -> list[tuple[int, str, LoRALinear]]:
    """Wrap every decoder layer's linears (once); (layer index, module name, wrapper)."""
    wrapped = []
    for i, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, subs in SUB_PROJECTIONS.items():
                mod = getattr(parent, name, None)
                if mod is None:
                    continue
                if not isinstance(mod, LoRALinear):
                    sizes = _split_sizes(parent, name, int(mod.out_features))
                    mod = LoRALinear(mod, sizes, subs)
                    setattr(parent, name, mod)
                wrapped.append((i, name, mod))
    return wrapped


def _split_sizes(parent: nn.Module, name: str, out: int) -> list[int]:
    if name == "qkv_proj":
        return [parent.q_size, parent.kv_size, parent.kv_size]
    if name == "gate_up_proj":
        return [out // 2, out // 2]
    return [out]


def lora_linears(model: nn.Module) -> list[tuple[int, LoRALinear]]:
    return [(i, m) for i, layer in enumerate(model.model.layers)
            for m in layer.modules() if isinstance(m, LoRALinear)]
