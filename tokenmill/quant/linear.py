"""Weight-only quantized linears on torch's CPU kernels.

Both kernels run in bfloat16 whatever the model's dtype: their x86 vector paths
(AVX512 and AVX2) exist only for bf16 inputs; with float32 inputs they fall back
to scalar loops 13-27x slower (measured, torch 2.13). Inputs are cast to bf16 at
the edge and outputs back. The kernels dequantize in fp32 from bf16 scales and
zeros and accumulate in fp32, so a result equals the dequantized reference
within bf16 rounding (of the input, the scales and zeros, and the output).

At larger batches a bf16 matmul beats the low-bit kernels on AVX512-BF16 CPUs
(benchmarks/kernels/linear_kernels.py), so a quantized linear may also hold a dense
weight (dense.py: packed for oneDNN) and use it for inputs of at least
`dense_min_rows` rows.

`Int4Linear(activations="int8" or "int16")` runs instead on
tokenmill/kernels/q4q8_gemv.c: the input quantized per block of 32 to int8 (or
int16, as two int8 planes) on the fly, exact integer dot products with the
weight's codes (AVX512-VNNI), fp32 scaling (vnni.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType
from torch import nn

from tokenmill.kernels import layer_ops, q4q8_gemv
from tokenmill.quant import gguf_records, vnni
from tokenmill.quant.codes import GGUF_NATIVE_TYPES, GROUP_SIZE, int4_codes_from_gguf
from tokenmill.quant.dense import DenseWeight

KERNEL_DTYPE = torch.bfloat16
_N_MULTIPLE = 16  # the int4 pack op needs out_features divisible by 16
ACTIVATIONS = {"bf16": 16, "int8": 8, "int16": 16}  # Int4Linear's input precisions -> bits


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) with a low-bit W; subclasses implement `_lowbit(x2d)`."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                 dense_weight: torch.Tensor | Any | None, dense_min_rows: int | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = None if bias is None else bias.detach()
        # a plain attribute, not a buffer: oneDNN's packed copy, or a plain tensor that
        # may be the tied embedding's own (see dense.py); or a weight prepared by the
        # caller with DenseWeight's interface (int8_dynamic.Int8DynamicWeight)
        self.dense = (None if dense_weight is None else DenseWeight(dense_weight)
                      if isinstance(dense_weight, torch.Tensor) else dense_weight)
        self.dense_min_rows = dense_min_rows if dense_weight is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, KERNEL_DTYPE).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """self(x) as fp32, its sums not rounded to x's dtype: an LM head's logits. Rounded
        to bf16 (a step of 1/16 at a logit of 16), the top two logits of a greedy choice
        tie where fp32 tells them apart, and the tie goes to the lower token id."""
        y = self._matmul(x, torch.float32)
        return y if self.bias is None else y + self.bias.float()

    def _matmul(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """x W^T in out_dtype (where a kernel writes only bf16, its values widened): the
        dense weight for `dense_min_rows` rows or more, else the low-bit one."""
        rows = x.numel() // self.in_features
        x2d = x.reshape(rows, self.in_features).to(KERNEL_DTYPE).contiguous()
        if self.dense is not None and rows >= self.dense_min_rows:  # type: ignore[operator]
            y = self.dense(x2d, out_dtype=out_dtype)
        else:
            y = self._lowbit(x2d, out_dtype=out_dtype)
        return y.reshape(*x.shape[:-1], self.out_features).to(out_dtype)

    def _lowbit(self, x2d: torch.Tensor, out_dtype: torch.dtype = KERNEL_DTYPE) -> torch.Tensor:
        raise NotImplementedError

    def lowbit_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"dense_min_rows={self.dense_min_rows}"
                + (f", activations={self.activations}" if hasattr(self, "activations") else ""))


class Int4Linear(QuantizedLinear):
    """Group-32 asymmetric int4, w = (q - 8) * scale + zero.
    `input_repeats` = 2 is the Q8_0 form: K * 2 codes against the input [x | x].
    `activations`: "bf16" (torch's kernel), "int8" or "int16" (dynamically quantized
    inputs, vnni.py); where that kernel is not built or has no exact form of the
    weight, "bf16" (the attribute says which runs)."""

    weight_form: str | None = None  # how GGUF records stand for the file (gguf_records.FORMS)

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None = None, input_repeats: int = 1,
                 dense_weight: torch.Tensor | None = None,
                 dense_min_rows: int | None = None, activations: str = "bf16") -> None:
        # codes: (N, K * input_repeats) in 0..15; scale, zero: (N, K * input_repeats / 32)
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, "
                             f"not {activations!r}")
        out_features, num_codes = codes.shape
        super().__init__(num_codes // input_repeats, out_features, bias, dense_weight,
                         dense_min_rows)
        self.input_repeats = input_repeats
        repacked = vnni.repack(codes, scale, zero, input_repeats) if activations != "bf16" \
            else None
        self.activations = "bf16" if repacked is None else activations
        if repacked is not None:
            self._take_records(repacked)
            return
        pad = -out_features % _N_MULTIPLE
        if pad:  # padded rows: code 8, scale 0, zero 0 -> weight 0, sliced off the output
            codes = F.pad(codes, (0, 0, 0, pad), value=8)
            scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 1))  # (N_pad, num_codes / 2) uint8
        self.register_buffer("scales_and_zeros", torch.stack(
            [scale.t(), zero.t()], dim=-1).to(KERNEL_DTYPE).contiguous())  # (groups, N_pad, 2)

    @classmethod
    def from_records(cls, repacked: tuple[torch.Tensor, int], in_features: int,
                     out_features: int, input_repeats: int, activations: str,
                     bias: torch.Tensor | None = None, dense_weight: torch.Tensor | None = None,
                     dense_min_rows: int | None = None) -> Int4Linear:
        """An Int4Linear on the int8/int16-activation kernel from its records (vnni.py's
        `repack` or `repack_gguf`), without the codes."""
        if activations not in ("int8", "int16"):
            raise ValueError(f"records need activations int8 or int16, not {activations!r}")
        self = cls.__new__(cls)
        QuantizedLinear.__init__(self, in_features, out_features, bias, dense_weight,
                                 dense_min_rows)
        self.input_repeats = input_repeats
        self.activations = activations
        self._take_records(repacked)
        return self

    def _take_records(self, repacked: tuple[torch.Tensor, int]) -> None:
        self.register_buffer("vnni_packed", repacked[0])  # records, see q4q8_gemv.c
        self.vnni_format = repacked[1]
        self.vnni_bits = ACTIVATIONS[self.activations]
        self._vnni = q4q8_gemv.bind(self.in_features, self.out_features, repacked[1],
                                    self.vnni_bits)
        self._vnni_silu = q4q8_gemv.bind(self.in_features, self.out_features, repacked[1],
                                         self.vnni_bits, silu_mul=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the decode step's case in as few Python ops as possible: at batch 1 the
        # wrapper's ops cost as much as the kernel (BENCHMARKS.md "Batch-1 kernels")
        if (self.activations != "bf16" and self._vnni is not None and x.dtype is KERNEL_DTYPE
                and x.dim() == 2 and x.shape[1] == self.in_features and self.bias is None
                and x.is_contiguous()
                and (self.dense_min_rows is None or x.shape[0] < self.dense_min_rows)):
            return self._vnni(x, self.vnni_packed)
        return super().forward(x)

    def silu_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for gate_up (..., 2 * in_features) = [gate | up]: in one
        native call on the decode step's rows (an MLP's down projection)."""
        if (self.activations != "bf16" and self._vnni_silu is not None
                and gate_up.dtype is KERNEL_DTYPE and gate_up.dim() == 2
                and gate_up.shape[1] == 2 * self.in_features and self.bias is None
                and gate_up.is_contiguous()
                and (self.dense_min_rows is None or gate_up.shape[0] < self.dense_min_rows)):
            return self._vnni_silu(gate_up, self.vnni_packed)
        act = layer_ops.silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self(act)

    def _lowbit(self, x2d: torch.Tensor, out_dtype: torch.dtype = KERNEL_DTYPE) -> torch.Tensor:
        if self.activations != "bf16":
            y = q4q8_gemv.linear(x2d, self.vnni_packed, self.out_features, self.vnni_format,
                                 out_dtype=out_dtype, bits=self.vnni_bits)
            if y is None:
                raise RuntimeError("the quantized-activation kernel (q4q8_gemv) did not take its input")
            return y
        if self.input_repeats > 1:
            x2d = x2d.repeat(1, self.input_repeats)  # (M, K * input_repeats)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.packed, GROUP_SIZE,
                                                       self.scales_and_zeros)
        return y if y.shape[1] == self.out_features else y[:, :self.out_features]


class Int8Linear(QuantizedLinear):
    """Per-output-row symmetric int8, w = q * scale."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None, dense_weight: torch.Tensor | None = None,
                 dense_min_rows: int | None = None) -> None:
        out_features, in_features = codes.shape
        super().__init__(in_features, out_features, bias, dense_weight, dense_min_rows)
        self.register_buffer("weight_int8", codes.to(torch.int8).contiguous())  # (N, K)
        self.register_buffer("scales", scale.reshape(-1).to(KERNEL_DTYPE).contiguous())  # (N,)

    def _lowbit(self, x2d: torch.Tensor, out_dtype: torch.dtype = KERNEL_DTYPE) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2d, self.weight_int8, self.scales)


def gguf_int4_linear(shards: Sequence[Any], bias: torch.Tensor | None = None,
                     dense_weight: torch.Tensor | None = None,
                     dense_min_rows: int | None = None, activations: str = "bf16"
                     ) -> Int4Linear:
    """An Int4Linear from the GGUF blocks of one or several (fused) checkpoint tensors.

    shards: the loader's `QuantizedWeight`s (.qtype, .blocks uint8 (rows, bytes_per_row),
    .shape), in row order. If one shard is Q8_0, Q4 shards take the Q8_0 form too
    (an all-zero first half), which doubles their bytes."""
    new_types = any(s.qtype not in GGUF_NATIVE_TYPES for s in shards)
    if activations != "bf16" and (new_types or len({s.qtype for s in shards}) > 1):
        # K-quants, Q5_*, mixed types: records per gguf_records.FORMS
        repacked = gguf_records.repack_shards(shards)
        if repacked is None:
            raise ValueError(f"no record form for GGUF types "
                             f"{', '.join(sorted({QType(s.qtype).name for s in shards}))}")
        rows, in_features = sum(s.shape[0] for s in shards), shards[0].shape[1]
        linear = Int4Linear.from_records(
            repacked[:2], in_features, rows, 1 if repacked[1] == q4q8_gemv.FORMAT_Q4 else 2,
            activations, bias, dense_weight, dense_min_rows)
        linear.weight_form = repacked[2]
        return linear
    if new_types:
        raise ValueError("GGUF types other than Q4_0/Q4_1/Q8_0 need int8/int16 activations")
    if len({s.qtype for s in shards}) == 1:  # unpack the concatenated bytes once
        blocks = torch.cat([s.blocks for s in shards]) if len(shards) > 1 else shards[0].blocks
        rows, in_features = sum(s.shape[0] for s in shards), shards[0].shape[1]
        if activations != "bf16":  # the kernel's records straight from the bytes
            repacked = vnni.repack_gguf(blocks, shards[0].qtype, (rows, in_features))
            if repacked is not None:
                linear = Int4Linear.from_records(
                    repacked, in_features, rows, 1 if repacked[1] == q4q8_gemv.FORMAT_Q4 else 2,
                    activations, bias, dense_weight, dense_min_rows)
                linear.weight_form = gguf_records.FORMS[QType(shards[0].qtype)]
                return linear
        parts = [int4_codes_from_gguf(blocks, shards[0].qtype, (rows, in_features))]
    else:
        parts = [int4_codes_from_gguf(s.blocks, s.qtype, s.shape) for s in shards]
    repeats = max(p[3] for p in parts)
    if repeats == 2:
        parts = [p if p[3] == 2 else _q8_form(*p[:3]) for p in parts]
    codes, scale, zero = (torch.cat([p[i] for p in parts]) if len(parts) > 1 else parts[0][i]
                          for i in range(3))
    return Int4Linear(codes, scale, zero, bias, repeats, dense_weight, dense_min_rows,
                      activations)


def _q8_form(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Int4 codes as [zero part | codes]: code 8 with scale 0 and zero 0 is weight 0."""
    return (torch.cat([torch.full_like(codes, 8), codes], dim=1),
            torch.cat([torch.zeros_like(scale), scale], dim=1),
            torch.cat([torch.zeros_like(zero), zero], dim=1), 2)
