"""A Llama MLP whose SiLU * up runs inside its down projection's native call.

`quantize_model` swaps it in, from outside the model, for each `LlamaMLP` whose
down projection runs the quantized-activation kernel (gguf-a16 / gguf-a8): one
native call fewer per layer at decode, with the same values (the kernel computes
silu(gate) * up exactly as layer_ops.silu_mul does). The children keep their names
(`gate_up_proj`, `down_proj`), so module paths do not change.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed.parallel_state import get_tp
from tokenmill.quant.linear import Int4Linear


class FusedSiluMLP(nn.Module):
    def __init__(self, gate_up_proj: Int4Linear, down_proj: Int4Linear) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # as LlamaMLP: under tensor parallelism down_proj is row-parallel, its output
        # this rank's partial sum
        return get_tp().all_reduce(self.down_proj.silu_mul_forward(self.gate_up_proj(x)))
