"""Parameters whose float values are filled only if something asks for them.

A GGUF file's quantized linears mostly run on their own blocks (quant/), so the
float weight the model's `Linear` declares is never read: dequantizing every one at
load, only for `quantize_model` to drop it, made a ~1B Q4_K_M model's load peak at
4.8 GB against 1.2 GB resident after (issue 56). The loader instead `defer`s such a
parameter: it keeps its shape, dtype and device, but its data is one element
broadcast to that shape (no storage), and the fill that would have run is kept on
it. Whoever needs the values (a large-batch bf16 copy, a linear kept float, a
method that quantizes from float) calls `materialize` first; a parameter whose
module is replaced by a quantized one is never filled and its memory never touched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

_FILLS = "deferred_fills"  # attribute on the Parameter: the fills still to run


def defer(param: nn.Parameter, fill: Callable[[], None]) -> None:
    """Keep `fill` (which writes some rows of `param`, e.g. one shard of a fused
    linear) for later, and drop the parameter's storage until then."""
    fills = getattr(param, _FILLS, None)
    if fills is None:
        fills = []
        setattr(param, _FILLS, fills)
        param.data = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
    fills.append(fill)


def is_deferred(param: torch.Tensor | None) -> bool:
    return param is not None and getattr(param, _FILLS, None) is not None


def materialize(param: torch.Tensor | None) -> None:
    """Give a deferred parameter its storage and run its fills; nothing otherwise."""
    fills = None if param is None else getattr(param, _FILLS, None)
    if fills is None:
        return
    delattr(param, _FILLS)
    param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    for fill in fills:
        fill()


def materialize_module(module: nn.Module) -> None:
    """Every deferred parameter of `module` itself (not of its children)."""
    for param in module.parameters(recurse=False):
        materialize(param)


def materialize_all(model: nn.Module) -> int:
    """Every deferred parameter still in the model; how many were filled."""
    pending = [p for p in model.parameters() if is_deferred(p)]
    for param in pending:
        materialize(param)
    return len(pending)
