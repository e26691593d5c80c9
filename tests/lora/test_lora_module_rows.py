"""The module path's LoRA deltas (models/lora.py), which every prefill with adapters and
every mixed prefill + decode step runs: however a step's rows fall (each adapter's rows
in a few consecutive runs, as a prefill's sequences lay them out; one run; one row a
run, as decode rows are), each adapter's rows get the delta of the per-sub-projection,
row-by-row index_add_ formulation, and the base's rows stay bit-identical to the base
linear's output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.models.lora import LoRALinear, lora_batch

IN, SIZES, NAMES = 64, [64, 32, 32], ("q_proj", "k_proj", "v_proj")


def _linear() -> LoRALinear:
    gen = torch.Generator().manual_seed(0)
    base = nn.Linear(IN, sum(SIZES), bias=False).bfloat16()
    mod = LoRALinear(base, SIZES, NAMES)
    for lora_id, rank, names in ((1, 8, NAMES), (2, 5, ("q_proj", "v_proj"))):
        mod.install(lora_id, {n: ((torch.randn(rank, IN, generator=gen) * IN ** -0.5)
                                  .bfloat16(),
                                  (torch.randn(s, rank, generator=gen) * 0.3).bfloat16())
                              for n, s in zip(NAMES, SIZES) if n in names})
    return mod


def _reference(mod: LoRALinear, x: torch.Tensor, groups: dict[int, torch.Tensor]
               ) -> torch.Tensor:
    """The deltas added row by row (index_add_), as the module path added them before."""
    y = mod.base(x)
    for lora_id, rows in groups.items():
        w = mod.adapters[lora_id]
        xa = x.index_select(0, rows) @ w.a_cat.t()
        for start, size, r0, r, b in w.parts:
            y.narrow(1, start, size).index_add_(0, rows, (xa[:, r0:r0 + r] @ b.t()))
    return y


def _layout(kind: str, n: int) -> list[int]:
    """Each row's adapter (0: the base)."""
    if kind == "runs":  # sequences of 7-13 tokens under adapters 1, 0, 2, 1, 2, ...
        out, i = [], 0
        while len(out) < n:
            out += [(0, 1, 2)[(i * 5 + 1) % 3]] * (7 + i % 7)
            i += 1
        return out[:n]
    if kind == "one":  # one adapter's rows, one run, between base rows
        return [0] * 10 + [1] * (n - 20) + [0] * 10
    return [(0, 1, 2)[i % 3] for i in range(n)]  # scattered: one run a row


@pytest.mark.parametrize("kind", ["runs", "one", "scattered"])
def test_module_path_deltas_equal_row_by_row(kind):
    mod = _linear()
    n = 150
    loras = _layout(kind, n)
    groups = {i: torch.tensor([r for r, a in enumerate(loras) if a == i])
              for i in (1, 2) if i in loras}
    x = torch.randn(n, IN, generator=torch.Generator().manual_seed(1)).bfloat16()
    with lora_batch(groups):
        got = mod(x)
    assert torch.equal(got, _reference(mod, x, groups))
    base_rows = torch.tensor([r for r, a in enumerate(loras) if a == 0])
    if len(base_rows):
        assert torch.equal(got[base_rows], mod.base(x)[base_rows])
    assert not torch.equal(got, mod.base(x))  # the adapters did add something
