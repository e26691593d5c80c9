"""Which arithmetic a path's linears ran while the gate scored it (issue 57): every
call of a GGUF linear (Int4Linear) counted by its rows under the route it takes,

    "kernel int8" / "kernel int16"   the quantized-activation per-row kernel
                                     (q4q8_gemv: what batch-1 decode runs)
    "dense <kind>"                   the large-batch weight, from dense_min_rows rows
                                     (bf16 packed for oneDNN, mlp-int8's int8
                                     records, w8a8's)
    "torch int4"                     activations bf16 (torch's int4 kernel)

so a row of the table says which kernels produced it: at 256-row prompt steps
gguf-a16 and gguf-a8 both run "dense" (the same packed bf16 weights), at 16-row
steps their own kernels. The route is read the way Int4Linear.forward /
silu_mul_forward / QuantizedLinear._matmul choose it; a test holds the two together.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator


def route(module, rows: int) -> str:
    """The route Int4Linear takes for `rows` rows (tokenmill/quant/linear.py)."""
    dense_min = module.dense_min_rows
    if module.dense is not None and dense_min is not None and rows >= dense_min:
        return f"dense {_dense_name(module.dense)}"
    if module.activations != "bf16":
        return f"kernel {module.activations}"
    return "torch int4"


# the large-batch weights' classes by what they compute with
_DENSE = {"Int8ActivationWeight": "int8 records",
          "Int8DynamicWeight": "w8a8", "WidenedWeight": "int16 records"}


def _dense_name(dense) -> str:
    kind = type(dense).__name__
    if kind in _DENSE:
        return _DENSE[kind]
    dtype = getattr(dense, "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else kind


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """Counter of rows per route over every Int4Linear call inside the block."""
    from tokenmill.quant.linear import Int4Linear

    seen: Counter = Counter()
    forward, silu = Int4Linear.forward, Int4Linear.silu_mul_forward

    def counted_forward(self, x):
        seen[route(self, x.numel() // self.in_features)] += x.numel() // self.in_features
        return forward(self, x)

    def counted_silu(self, gate_up):
        # counted here when the fused call takes it; else self(act) counts it once
        rows = gate_up.numel() // (2 * self.in_features)
        if route(self, rows).startswith("kernel") and self._vnni_silu is not None:
            seen[route(self, rows)] += rows
        return silu(self, gate_up)

    Int4Linear.forward, Int4Linear.silu_mul_forward = counted_forward, counted_silu
    try:
        yield seen
    finally:
        Int4Linear.forward, Int4Linear.silu_mul_forward = forward, silu


def shares(seen: Counter) -> dict[str, float]:
    """Route -> % of the linear rows (sorted, largest first)."""
    total = sum(seen.values())
    return {k: round(100.0 * v / total, 1) for k, v in seen.most_common()} if total else {}
