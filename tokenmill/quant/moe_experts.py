"""A GGUF file's MoE experts kept in their quantized-activation kernel records.

The loader keeps each stacked expert tensor's blocks (`ffn_{gate,up,down}_exps`,
(E, rows, cols)) on the model's `Experts` stacks; `swap_in` turns them, one expert
at a time, into the records of gguf_records (one `repack_shards` call per expert and
projection: gate and up fused into one gate_up record set, rows [0, I) gate and
[I, 2I) up, as the float stack's layout; down alone) and replaces the float `Experts`
module, whose dequantized stacks are then freed: the experts' resident bytes are
about the file's (gguf_records.FORMS says how each type's records stand for its
blocks).

`RecordExperts.forward` runs the grouping of models/moe_compute.py: each active
expert's tokens go through that expert's records, gate_up then down with silu * up
inside the down call; at `GEMM16_MIN_ROWS` tokens or more (prefill chunks, large
batches) through gemm16 instead, the same bits with the weights widened once per call
(on AVX2). A batch-1 decode step reads only its k routed experts' records.

Types with no record form (gguf_records.RECORD_TYPES) keep the dequantized float
experts, named in the start-up log as dense linears are.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from gguf import GGMLQuantizationType as QType
from torch import nn

from tokenmill import malloc
from tokenmill.kernels import layer_ops, q4q8_gemv
from tokenmill.models.moe import Experts, StackedExpertWeight
from tokenmill.models.moe_compute import ExpertTraffic, grouped
from tokenmill.quant import gguf_records

# tokens of one expert from which gemm16 takes over from the per-row kernel: the fused
# decode step's crossover for whole steps of these kernels (engine/runner/
# fused_decode.py WIDE_MIN_ROWS, AVX2: 1.00 at 8 rows, 1.12 at 16); on AVX512-VNNI
# gemm16 is the per-row kernel itself
GEMM16_MIN_ROWS = 12
_BLOCKS_ATTR = "gguf_quantized"  # where the loader keeps a module's GGUF blocks


class _Shard:
    """One expert's rows of a stacked tensor, as gguf_records reads a loader shard."""

    def __init__(self, qtype: Any, blocks: torch.Tensor, shape: tuple[int, int],
                 row_offset: int) -> None:
        self.qtype, self.blocks, self.shape, self.row_offset = qtype, blocks, shape, row_offset


def _expert_shards(shards: list[Any], expert: int) -> list[_Shard]:
    """The loader's stacked shards (blocks (E, rows * bytes_per_row), shape (E, rows,
    cols)) -> expert's own rows of each, in row order."""
    out = []
    for s in sorted(shards, key=lambda s: s.row_offset):
        rows, cols = int(s.shape[1]), int(s.shape[2])
        out.append(_Shard(s.qtype, s.blocks[expert].reshape(rows, -1), (rows, cols),
                          s.row_offset))
    return out


def _covers(shards: list[Any] | None, rows: int, cols: int, experts: int) -> bool:
    """Whether the stacked shards fill every row of an (experts, rows, cols) stack."""
    row = 0
    for s in sorted(shards or [], key=lambda s: s.row_offset):
        if len(s.shape) != 3 or s.shape[0] != experts or s.shape[2] != cols \
                or s.row_offset != row:
            return False
        row += s.shape[1]
    return bool(shards) and row == rows


class RecordExperts(nn.Module):
    """E experts' SwiGLU MLPs on the quantized-activation kernel: per expert, gate_up
    records (2 * I, hidden) and down records (hidden, I), each in its own format."""

    def __init__(self, gate_up: list[tuple[torch.Tensor, int]],
                 down: list[tuple[torch.Tensor, int]], hidden: int, intermediate: int,
                 bits: int, forms: dict[str, Counter[str]]) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = len(gate_up), hidden, intermediate
        self.bits = bits
        self.gate_up_records = [r for r, _ in gate_up]  # records, one tensor an expert
        self.gate_up_formats = [f for _, f in gate_up]
        self.down_records = [r for r, _ in down]
        self.down_formats = [f for _, f in down]
        self.forms = forms  # tensor class -> "TYPE as form" -> experts (weight_report)
        self.expert_bytes = [g.nbytes + d.nbytes
                             for g, d in zip(self.gate_up_records, self.down_records,
                                             strict=True)]
        self.traffic = ExpertTraffic()  # this rank's reads (models/moe.py expert_bytes_read)
        self._gate_up: dict[int, Callable[..., torch.Tensor]] = {}
        self._down_silu: dict[int, Callable[..., torch.Tensor]] = {}
        # each projection bound in the formats it has only: a super-block format (Q4_K's
        # own records) binds where its width divides by 256, which the other may not
        for fmt in set(self.gate_up_formats):
            self._gate_up[fmt] = self._bound(hidden, 2 * intermediate, fmt, bits)
        for fmt in set(self.down_formats):
            self._down_silu[fmt] = self._bound(intermediate, hidden, fmt, bits, silu_mul=True)

    @staticmethod
    def _bound(k: int, n: int, fmt: int, bits: int, silu_mul: bool = False
               ) -> Callable[..., torch.Tensor]:
        call = q4q8_gemv.bind(k, n, fmt, bits, silu_mul=silu_mul)
        if call is None:
            raise RuntimeError("the quantized-activation kernel (q4q8_gemv) is not built, "
                               f"or takes no format {fmt} rows of {k} inputs")
        return call

    def records_bytes(self) -> int:
        return sum(self.expert_bytes)

    def _expert_mlp(self, expert: int, xs: torch.Tensor) -> torch.Tensor:
        """xs (n, hidden) -> down(silu(gate(xs)) * up(xs)) (n, hidden) bf16."""
        xs = xs.to(torch.bfloat16).contiguous()
        gu_fmt, dn_fmt = self.gate_up_formats[expert], self.down_formats[expert]
        if self.bits == 16 and xs.shape[0] >= GEMM16_MIN_ROWS:
            gate_up = q4q8_gemv.gemm16(xs, self.gate_up_records[expert],
                                       2 * self.intermediate, gu_fmt)
            act = layer_ops.silu_mul(gate_up)
            if act is None:
                raise RuntimeError("the native silu_mul kernel (layer_ops) is not built")
            return q4q8_gemv.gemm16(act, self.down_records[expert], self.hidden, dn_fmt)
        gate_up = self._gate_up[gu_fmt](xs, self.gate_up_records[expert])  # (n, 2I)
        return self._down_silu[dn_fmt](gate_up, self.down_records[expert])  # (n, hidden)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """As models/moe.py Experts: x (T, hidden), routing weights and ids (T, k) ->
        (T, hidden), this rank's partial sum under tensor parallelism."""
        return grouped(x, weights, ids, self.num_experts, self._expert_mlp,
                       self.expert_bytes, self.traffic)


def _repacked(experts: int, shards: list[Any]) -> tuple[list[tuple[torch.Tensor, int]],
                                                         Counter[str]] | None:
    """Per expert (records, format), and "TYPE as form" -> count; None where a type has
    no record form."""
    out, forms = [], Counter[str]()
    types = "+".join(sorted({QType(s.qtype).name for s in shards}))
    for e in range(experts):
        repacked = gguf_records.repack_shards(_expert_shards(shards, e))
        if repacked is None:
            return None
        out.append(repacked[:2])
        forms[f"{types} as {repacked[2]}"] += 1
    return out, forms


def stacked_shards(module: nn.Module) -> list[Any] | None:
    """The loader's GGUF blocks kept on a stacked expert weight (models/moe.py)."""
    return module.__dict__.get(_BLOCKS_ATTR)


def no_records_reason(experts: Experts) -> str | None:
    """Why these experts cannot run on records (None: they can)."""
    h, inter, e = experts.w2.weight.shape[1], experts.intermediate, experts.num_experts
    if experts.w13.weight.device.type != "cpu":
        return f"on {experts.w13.weight.device.type}; the record kernels are CPU only"
    w13, w2 = stacked_shards(experts.w13), stacked_shards(experts.w2)
    if not (_covers(w13, 2 * inter, h, e) and _covers(w2, h, inter, e)):
        return "no quantized GGUF blocks from the loader"
    types = {QType(s.qtype) for s in [*w13, *w2]}  # type: ignore[misc]
    missing = sorted(t.name for t in types if t not in gguf_records.RECORD_TYPES)
    if missing:
        return f"GGUF type {', '.join(missing)} has no native kernel: dequantized"
    if h % 32 or inter % 32:
        return f"hidden {h} or expert width {inter} is not a multiple of 32"
    if not q4q8_gemv.available():
        return "the quantized-activation kernel (q4q8_gemv) is not built"
    return None


def release_blocks(stack: StackedExpertWeight) -> None:
    """Forget a stacked weight's GGUF blocks and the deferred float fill that reads them,
    once their records exist. The replaced `Experts` is only collected at
    the next cyclic GC (its parameter's weight_loader refers back to it), so without this
    every layer's blocks stayed resident beside all the records until the load ended:
    the synthetic MoE file's 1.2 GB of expert blocks, a 3.6 GB peak for a 1.2 GB file."""
    stack.__dict__.pop(_BLOCKS_ATTR, None)
    stack.pending.clear()


def swap_in(model: nn.Module, bits: int, summary: Any) -> None:
    """Replace every `Experts` whose stacks the loader kept GGUF blocks for by a
    RecordExperts (`bits`: the activations' precision, 8 or 16); the others are named
    in summary.kept_float with the reason. Each layer's blocks are freed as soon as its
    records exist and the heap trimmed (a layer's blocks are tens of MB and often sit
    inside the heap): the load's peak is then the blocks of the layers not yet repacked
    plus the records of those that are, about the file's expert bytes."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, Experts):
            continue
        why = no_records_reason(module)
        if why is not None:
            if stacked_shards(module.w13) or stacked_shards(module.w2):
                summary.kept_float[name] = why
            continue
        experts, h = module.num_experts, module.w2.weight.shape[1]
        gate_up = _repacked(experts, stacked_shards(module.w13))  # type: ignore[arg-type]
        down = _repacked(experts, stacked_shards(module.w2))  # type: ignore[arg-type]
        if gate_up is None or down is None:  # checked above; the kernel may be missing
            summary.kept_float[name] = "no record form"
            continue
        new = RecordExperts(gate_up[0], down[0], h, module.intermediate, bits,
                            {"experts.gate_up": gate_up[1], "experts.down": down[1]})
        parent, _, leaf = name.rpartition(".")
        model.get_submodule(parent).register_module(leaf, new)
        summary.quantized.append(name)
        summary.lowbit_bytes += new.records_bytes()
        release_blocks(module.w13)  # now: the old module lives on until a cyclic GC
        release_blocks(module.w2)
        malloc.trim()


def kept_float_reasons(model: nn.Module, summary: Any) -> None:
    """Methods that do not run experts on records: experts holding GGUF blocks are named
    in summary.kept_float (their dequantized float stacks run)."""
    for name, module in model.named_modules():
        if isinstance(module, Experts) and (stacked_shards(module.w13)
                                            or stacked_shards(module.w2)):
            summary.kept_float[name] = (no_records_reason(module)
                                        or f"--quantization {summary.method}: experts run "
                                        "their records only with gguf-a16 or gguf-a8: "
                                        "dequantized")
