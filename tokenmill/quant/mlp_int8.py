"""The large-batch path of a GGUF MLP's linears on int8 activations: its own records.

A prompt chunk's linears are compute-bound: 512 rows through oneDNN's packed bf16
matmul run at ~85% of what `vdpbf16ps` allows (32 multiply-adds an instruction). The
quantized-activation kernel (q4q8_gemv.c) at 8 bits does 64 with `vpdpbusd`, on the
records the linear already holds (the GGUF weights' own integers, exact int32 block
sums, fp32 scaling: llama.cpp's Q4_1 x Q8 arithmetic). Activations at 8 bits for
every linear miss the accuracy gate (gguf-a8: ~96% greedy top-1 with fp32 against the
97% asked); the attention's q/k/v carry the sensitive part, and a torch emulation
with them left in bf16 reads 97.7% (BENCHMARKS.md). `--batched-linears mlp-int8` gives
the MLP's linears (gate_up and down, ~¾ of a decoder layer's multiply-adds) this weight
for their large batches and leaves attention's and the LM head's on packed bf16; no
float copy of the MLP's weights is kept. `--batched-linears int8` gives it to the
attention's qkv_proj and o_proj and to the LM head as well (no float copy at all; the
head's records ran Gemma 3's 20-256 rows in 0.47-0.71x its bf16 copy's time). `auto`
picks mlp-int8 on AVX512-VNNI (the KLD gate passes it on all four gated files) and
int8 for Gemma 3 on gguf-a8 (its gate passes that too: docs/accuracy_gate.md). A
512-token prefill: 323 -> 295 ms on the 2-core Zen 4 (mlp-int8 against packed bf16).

The interface of dense.DenseWeight: `__call__(x2d, out_dtype)`, `nbytes`, `weight`.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import q4q8_gemv
from tokenmill.quant.widened import RecordsWeight

MLP_LINEARS = ("gate_up_proj", "down_proj")
BITS = 8


def available() -> bool:
    """The kernel is built with AVX512-VNNI, where 8-bit activations run twice the
    multiply-adds an instruction of bf16 (elsewhere they would not pay)."""
    return q4q8_gemv.has_vnni()


class Int8ActivationWeight(RecordsWeight):
    """The linear's own records, run by the per-row kernel at 8 bits."""

    def __call__(self, x2d: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
                 ) -> torch.Tensor:
        """x2d: (M, K) bf16 -> (M, N) in out_dtype (bf16 or fp32)."""
        y = q4q8_gemv.linear(x2d.to(torch.bfloat16).contiguous(), self.records,
                             self.out_features, self.fmt, out_dtype=out_dtype, bits=BITS)
        if y is None:
            raise RuntimeError("the quantized-activation kernel (q4q8_gemv) did not take "
                               "its input")
        return y
