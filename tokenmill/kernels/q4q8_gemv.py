"""Low-bit GGUF weights times dynamically quantized int8 activations (q4q8_gemv.c).

`linear` returns None when the kernel is not built or does not take the tensors;
the caller then keeps its bf16-activation path. `isa` names the integer dot products
the build runs: AVX512-VNNI, AVX2 (vpmaddubsw, as llama.cpp on x86-64-v3), or a plain C
loop with the same arithmetic, far slower; `has_vnni` says whether it is the first.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from tokenmill.kernels.build import Library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_lib = Library("q4q8_gemv", {
    "tm_q4q8_has_vnni": ([], _I64),
    "tm_q4q8_isa": ([], _I64),
    "tm_q8_quantize_bf16": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR], None),
    "tm_q8_record_rows": ([_PTR, _I64, _I64, _PTR, _I64, _PTR], _I64),
    "tm_q4q8_linear": ([_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64], _I64),
    "tm_q4q8_silu_linear": ([_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64],
                            _I64),
    "tm_q4q8_gemm16": ([_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64], _I64),
})

FORMAT_Q4, FORMAT_Q8 = 0, 1  # weight record layouts, see q4q8_gemv.c
FORMAT_MIXED = 3  # parts of a fused linear, each in its own layout (a header, then each's)
FORMAT_Q5, FORMAT_Q6 = 4, 5  # Q4 records with a plane of 1 or 2 high bits a weight
FORMAT_Q4K = 6  # Q4_K's super-blocks of 256 with their 6-bit scales (4.5 bits a weight)
ROWS = 16  # output rows per repacked group
# per group of 16 rows and block of 32 (Q4K: a super-block's 2,304 bytes over its 8 blocks)
RECORD_BYTES = {FORMAT_Q4: 320, FORMAT_Q8: 544, FORMAT_Q5: 384, FORMAT_Q6: 448,
                FORMAT_Q4K: 288}
SUPER_BLOCK = {FORMAT_Q4K: 256}  # inputs a record spans where more than a block of 32
BITS = (8, 16)  # activation precisions, see q4q8_gemv.c
MIXED_HEADER, MIXED_PARTS = 64, 7


def mixed(parts: list[tuple[torch.Tensor, int]], in_features: int) -> tuple[torch.Tensor, int]:
    """Each part's records (its rows a multiple of ROWS but the last's) -> one weight's:
    (records, format), FORMAT_MIXED where the formats differ. Neighbouring parts of one
    format are joined."""
    runs: list[list] = []
    for records, fmt in parts:
        if runs and runs[-1][1] == fmt:
            runs[-1][0].append(records)
        else:
            runs.append([[records], fmt])
    if len(runs) == 1:
        return torch.cat(runs[0][0]), runs[0][1]
    if len(runs) > MIXED_PARTS:
        raise ValueError(f"{len(runs)} parts of different formats: at most {MIXED_PARTS}")
    header, end = [len(runs)], 0
    for records, fmt in runs:
        end += sum(r.numel() for r in records) // ((in_features // 32) * RECORD_BYTES[fmt])
        header += [end, fmt]
    head = torch.zeros(MIXED_HEADER, dtype=torch.uint8)
    head[:4 * len(header)] = torch.tensor(header, dtype=torch.int32).view(torch.uint8)
    return torch.cat([head, *(r for records, _ in runs for r in records)]), FORMAT_MIXED


def segments(packed: torch.Tensor, fmt: int, in_features: int
             ) -> list[tuple[int, int, int, torch.Tensor]]:
    """A weight's records as runs of groups of one format: (first group, groups, format,
    records) each."""
    if fmt != FORMAT_MIXED:
        return [(0, packed.numel() // ((in_features // 32) * RECORD_BYTES[fmt]), fmt, packed)]
    header = packed[:MIXED_HEADER].view(torch.int32).tolist()
    out, at, first = [], MIXED_HEADER, 0
    for i in range(header[0]):
        end, part_fmt = header[1 + 2 * i], header[2 + 2 * i]
        size = (end - first) * (in_features // 32) * RECORD_BYTES[part_fmt]
        out.append((first, end - first, part_fmt, packed[at:at + size]))
        at, first = at + size, end
    return out


def _mixed_bytes(packed: torch.Tensor, in_features: int) -> int:
    """The bytes a FORMAT_MIXED weight must hold for its header's groups."""
    header = packed[:MIXED_HEADER].view(torch.int32).tolist()
    return MIXED_HEADER + sum(
        (header[1 + 2 * i] - (header[2 * i - 1] if i else 0)) * (in_features // 32)
        * RECORD_BYTES[header[2 + 2 * i]] for i in range(header[0]))


def groups_of(packed: torch.Tensor, fmt: int, in_features: int) -> int | None:
    """The groups of ROWS rows `packed` holds, None where its header or size is not
    one the kernel reads."""
    if in_features % SUPER_BLOCK.get(fmt, 32):
        return None
    if fmt in RECORD_BYTES:
        per_group = (in_features // 32) * RECORD_BYTES[fmt]
        return packed.numel() // per_group if packed.numel() % per_group == 0 else None
    if fmt != FORMAT_MIXED or packed.numel() < MIXED_HEADER or in_features % 32:
        return None
    header = packed[:MIXED_HEADER].view(torch.int32).tolist()
    if not 1 <= header[0] <= MIXED_PARTS:
        return None
    ends, fmts = header[1:1 + 2 * header[0]:2], header[2:2 + 2 * header[0]:2]
    if any(f not in RECORD_BYTES or in_features % SUPER_BLOCK.get(f, 32) for f in fmts) or any(
            b <= a for a, b in zip([0, *ends], ends, strict=False)):
        return None
    return ends[-1] if _mixed_bytes(packed, in_features) == packed.numel() else None


def available() -> bool:
    return _lib.get("tm_q4q8_linear") is not None


def has_vnni() -> bool:
    fn = _lib.get("tm_q4q8_has_vnni")
    return fn is not None and bool(fn())


ISA_NAMES = {2: "avx512-vnni", 1: "avx2", 0: "c"}


def isa() -> str | None:
    """The integer dot products the built kernel runs (ISA_NAMES), None if not built."""
    fn = _lib.get("tm_q4q8_isa")
    return None if fn is None else ISA_NAMES[int(fn())]


def quantize(x: torch.Tensor, bits: int = 8
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """x (M, K) bf16 -> (v int32 (M, K), d fp32 (M, K / 32), sum int32 (M, K / 32)) with
    x ~ v * d per block of 32, the activations exactly as `linear` quantizes them with
    `bits` (8: |v| <= 127, 16: |v| <= 32512); None if not built."""
    fn = _lib.get("tm_q8_quantize_bf16")
    if fn is None or bits not in BITS:
        return None
    x = x.to(torch.bfloat16).contiguous()
    m, k = x.shape
    q = torch.zeros((2, m, k), dtype=torch.int8)  # the planes qh, ql
    d, s = (torch.empty((m, k // 32)) for _ in range(2))
    total = torch.empty((m, k // 32), dtype=torch.int32)
    fn(x.data_ptr(), m, k, bits, q.data_ptr(), d.data_ptr(), s.data_ptr(), total.data_ptr())
    v = q[0].int() * 256 + q[1].int() if bits == 16 else q[0].int()
    return v, d, -total // 128  # the kernel keeps -128 sum(v), what Q8 records add


def bind(in_features: int, out_features: int, fmt: int, bits: int = 8, silu_mul: bool = False
         ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """`linear` for one weight shape with its checks done once, for the decode loop:
    call(x2d, packed) -> (M, out_features) bf16, where the caller guarantees x2d (M,
    in_features) bf16 contiguous on the CPU and packed the weight's records. With
    silu_mul, x2d is (M, 2 * in_features) = [gate | up] and the input is
    silu(gate) * up, computed as layer_ops.silu_mul does, in the same call. None if not
    built."""
    fn = _lib.get("tm_q4q8_silu_linear" if silu_mul else "tm_q4q8_linear")
    if fn is None or in_features % SUPER_BLOCK.get(fmt, 32) or bits not in BITS:
        return None

    def call(x2d: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        rows = x2d.shape[0]
        y = torch.empty((rows, out_features), dtype=torch.bfloat16)
        if fn(x2d.data_ptr(), rows, in_features, packed.data_ptr(), out_features, fmt, bits,
              y.data_ptr(), 0, torch.get_num_threads()):
            raise MemoryError("q4q8_gemv: no scratch for the quantized activations")
        return y
    return call


def q8_record_rows(records: torch.Tensor, in_features: int, ids: torch.Tensor,
                   rows: int | None = None) -> torch.Tensor | None:
    """Rows `ids` (n,) int64 of the weight of `rows` rows (default: every row the
    records hold) in FORMAT_Q8 `records` (one segment) -> (n, in_features) fp32,
    d (q - 128) each; None where the kernel is not built or does not take them (an id
    out of range)."""
    fn = _lib.get("tm_q8_record_rows")
    groups = groups_of(records, FORMAT_Q8, in_features)
    if fn is None or groups is None or (rows is not None and not 0 < rows <= groups * ROWS):
        return None
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((ids.numel(), in_features), dtype=torch.float32)
    if fn(records.data_ptr(), rows or groups * ROWS, in_features, ids.data_ptr(), ids.numel(),
          out.data_ptr()):
        return None
    return out


def linear(x2d: torch.Tensor, packed: torch.Tensor, out_features: int, fmt: int,
           out_dtype: torch.dtype = torch.bfloat16, bits: int = 8) -> torch.Tensor | None:
    """x2d (M, K) bf16 contiguous, quantized to `bits` per block of 32, times a weight
    repacked by tokenmill.quant.vnni -> (M, out_features) in out_dtype (bf16 or fp32);
    None if not taken."""
    fn = _lib.get("tm_q4q8_linear")
    m, k = x2d.shape
    if (fn is None or x2d.dtype != torch.bfloat16 or not x2d.is_contiguous()
            or x2d.device.type != "cpu" or k % 32
            or out_dtype not in (torch.bfloat16, torch.float32) or bits not in BITS
            or groups_of(packed, fmt, k) != -(-out_features // ROWS)):
        return None
    y = torch.empty((m, out_features), dtype=out_dtype)
    rc = fn(x2d.data_ptr(), m, k, packed.data_ptr(), out_features, fmt, bits, y.data_ptr(),
            out_dtype == torch.float32, torch.get_num_threads())
    return y if rc == 0 else None



def gemm16(x2d: torch.Tensor, packed: torch.Tensor, out_features: int, fmt: int,
           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`linear(x2d, packed, ..., bits=16)`, bit for bit, for many rows: on AVX2 the
    records widened to int16 a few groups at a time, 16 multiply-adds a vpmaddwd
    (q4q8_gemv.c). The caller guarantees x2d (M, K) bf16 contiguous on the CPU and
    packed this weight's records."""
    fn = _lib.get("tm_q4q8_gemm16")
    m, k = x2d.shape
    y = torch.empty((m, out_features), dtype=out_dtype)
    if fn is None or fn(x2d.data_ptr(), m, k, packed.data_ptr(), out_features, fmt,
                        y.data_ptr(), out_dtype == torch.float32, torch.get_num_threads()):
        raise MemoryError("q4q8_gemv: gemm16 not built, or no scratch for its activations")
    return y
