"""The large-batch path of a gguf-a16 linear on AVX2: its own records, widened as read.

On a CPU without native bf16 (AVX2: no AVX512-BF16 or AMX) the dense weight a
quantized linear keeps for many rows (dense.py) is fp32, and oneDNN's fp32 matmul
reaches ~80 G multiply-adds/s on both cores of the 2-core AVX2 EPYC, about what the
per-row int16-activation kernel (q4q8_gemv.c) does at any batch. Many rows at once,
the kernel's gemm16 widens the records' integers to int16 pairs a few groups at a time
and lets one vpmaddwd do 16 multiply-adds (an FMA does 8): ~115 G/s on a layer's
shapes at 128-512 rows. The arithmetic is the per-row kernel's, so a prompt gets the
bits a decode step of the same rows gets, where the fp32 weight gave bf16 inputs times
dequantized weights; the accuracy gate covers it (benchmarks/accuracy.py). No copy of
the weights is kept (the fp32 one was 4 bytes a weight). The default for gguf-a16 on
such a CPU (`--batched-linears auto`). It was opt-in for a while: with prompts on
int16 activations the greedy chat reply to "What is the capital of France?" opened
with "L" and looped, because the LM head's logits were rounded to bf16 and the top two
(0.08 apart in fp32) tied; the logits are fp32 since (linear.py `forward_fp32`).

The interface of dense.DenseWeight: `__call__(x2d, out_dtype)`, `nbytes`, `weight`.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import q4q8_gemv


def available() -> bool:
    """The kernel is built with AVX2 (elsewhere gemm16 is the per-row kernel itself)."""
    return q4q8_gemv.isa() == "avx2"


class RecordsWeight:
    """A linear's own kernel records as its large-batch weight: no copy, never a model
    parameter; a subclass's __call__ says which kernel runs them."""

    weight = None  # never a model parameter
    nbytes = 0  # no copy: the records are the linear's own

    def __init__(self, records: torch.Tensor, in_features: int, out_features: int,
                 fmt: int) -> None:
        self.records, self.fmt = records, fmt
        self.in_features, self.out_features = in_features, out_features


class WidenedWeight(RecordsWeight):
    """The records widened to int16 as read (gemm16)."""

    def __call__(self, x2d: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
                 ) -> torch.Tensor:
        """x2d: (M, K) bf16 -> (M, N) in out_dtype (bf16 or fp32)."""
        return q4q8_gemv.gemm16(x2d.to(torch.bfloat16).contiguous(), self.records,
                                self.out_features, self.fmt, out_dtype)
