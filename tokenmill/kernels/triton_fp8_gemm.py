"""fp8 (e4m3) linears for decode batches of up to 64 rows, as a Triton kernel.

`torch._scaled_mm` gives cuBLASLt's fp8 GEMM, whose tiles are 128 x 128: at a
decode step's few rows it read the e4m3 weights at about half the rate the bf16
GEMV reads twice the bytes (gpu_check.py --profile on an H200, Llama-3-8B
shapes, batch 1: 3.7 of the step's 4.8 ms, against 3.6 ms for bf16's linears),
so fp8 decoded slower than bf16. Here one program holds all the rows (padded to
16, 32 or 64) and a 64-column slice of the weight, walks its share of K in
tiles of 256, and `tl.dot`s the e4m3 codes on tensor cores; narrow layers split
K across programs (partials in fp32, summed by a second kernel) so that the GPU
has work for every SM. The epilogue applies the row and column scales and the
bias as `_scaled_mm` does: y = (x_codes . w_codes) * x_scale * w_scale + b.

That is three launches a linear: the activation scales (triton_layer_ops'
quantize_rows_fp8), the GEMM and the split reduce. `fp8_linear` does them in one
for up to 16 rows: each program finds its rows' scales itself (a pass over the
rows, which L2 serves) and quantizes each tile in registers, and the last
program of a column tile to finish (an atomic count) sums the partials. The same
codes, scales and sums in the same order: the same bits as the three kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.spec import KernelSpec
from tokenmill.kernels.triton_layer_ops import _FP8_MAX

BLOCK_N = 64
BLOCK_K = 256
MAX_ROWS = 64


@triton.jit
def _fp8_epilogue(acc, xs, ws_ptr, bias_ptr, out_ptr, rows, cols, m, n, stride_out,
                  HAS_BIAS: tl.constexpr):
    col_ok = cols < n
    y = acc * xs[:, None] * tl.load(ws_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
             y.to(out_ptr.dtype.element_ty), mask=(rows < m)[:, None] & col_ok[None, :])


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, m,
                     n, k, tiles_per_split, stride_x, stride_w, stride_out,
                     QUANTIZE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # grid: (cdiv(n, BLOCK_N), splits). Without QUANTIZE, x is the e4m3 codes and
    # xs_ptr their row scales (rows past m zero codes, the padding), and a split's
    # partial goes to _fp8_gemm_reduce. With QUANTIZE (fp8_linear), x is the
    # activations, quantized here: each row's scale from its largest magnitude over
    # all of K (a first pass over the row, which L2 serves), each tile's codes in
    # registers; a split's program stores its partial and counts itself in, and the
    # last of a column tile sums the partials in split order and writes the output.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < m
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    x_rows = x_ptr + rows[:, None] * stride_x
    if QUANTIZE:
        amax = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < k)[None, :],
                        other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        xs = tl.maximum(amax / _FP8_MAX, 1e-12)  # quantize_rows_fp8's scale, row by row
    else:
        xs = tl.load(xs_ptr + rows, mask=row_ok, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = split * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k, k_start + tiles_per_split * BLOCK_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if QUANTIZE:
            x = tl.minimum(tl.maximum(x.to(tl.float32) / xs[:, None], -_FP8_MAX),
                           _FP8_MAX).to(w.dtype)
        acc += tl.dot(x, tl.trans(w))
    if SPLIT:
        tile = part_ptr + rows[:, None] * n + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        tl.store(tile + split * BLOCK_M * n, acc, mask=mask)
        if QUANTIZE:  # the split reduce in this launch
            splits = tl.num_programs(1)
            tl.debug_barrier()  # every thread's partial stored before the count
            if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") == splits - 1:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in range(splits):  # in order: the separate reduce's sums
                    acc += tl.load(tile + s * BLOCK_M * n, mask=mask, other=0.0)
                tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next launch (and replay)
                _fp8_epilogue(acc, xs, ws_ptr, bias_ptr, out_ptr, rows, cols, m, n,
                              stride_out, HAS_BIAS)
    else:
        _fp8_epilogue(acc, xs, ws_ptr, bias_ptr, out_ptr, rows, cols, m, n, stride_out,
                      HAS_BIAS)


@triton.jit
def _fp8_gemm_reduce(part_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr, n, splits, stride_out,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    # grid: (m, cdiv(n, BLOCK)): one row's columns, summed over the splits in order
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + (s * BLOCK_M + row) * n + cols, mask=ok, other=0.0)
    y = acc * tl.load(xs_ptr + row) * tl.load(ws_ptr + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def splits_for(n: int, k: int, num_sms: int) -> tuple[int, int]:
    """(splits, K tiles per split): enough programs for two per SM, each split a
    whole number of K tiles."""
    programs = triton.cdiv(n, BLOCK_N)
    tiles = triton.cdiv(k, BLOCK_K)
    want = max(1, min(tiles, triton.cdiv(2 * num_sms, programs)))
    per_split = triton.cdiv(tiles, want)
    return triton.cdiv(tiles, per_split), per_split


def fp8_gemm(codes: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
             w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
             rows: int, num_sms: int) -> torch.Tensor | None:
    """y (rows, N) = (codes[:rows] . weight^T) * x_scale * w_scale (+ bias), for codes
    (R, K) and weight (N, K) e4m3 with row-major K, x_scale (R, 1), w_scale (1, N)
    float32. None where it does not take the shapes (more than MAX_ROWS rows)."""
    n, k = weight.shape
    if (rows > MAX_ROWS or rows == 0 or codes.shape[1] != k or codes.stride(1) != 1
            or weight.stride(1) != 1 or not x_scale.is_contiguous()
            or not w_scale.is_contiguous()):
        return None
    block_m = max(16, triton.next_power_of_2(rows))
    splits, per_split = splits_for(n, k, num_sms)
    out = torch.empty((rows, n), dtype=out_dtype, device=codes.device)
    part = torch.empty((splits, block_m, n), dtype=torch.float32, device=codes.device) \
        if splits > 1 else out
    has_bias = bias is not None
    b = bias if bias is not None else w_scale
    _fp8_gemm_kernel[(triton.cdiv(n, BLOCK_N), splits)](
        codes, weight, x_scale, w_scale, b, out, part, x_scale, rows, n, k, per_split,
        codes.stride(0), weight.stride(0), out.stride(0), QUANTIZE=False, HAS_BIAS=has_bias,
        SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=4, num_stages=3)
    if splits > 1:
        _fp8_gemm_reduce[(rows, triton.cdiv(n, 1024))](
            part, x_scale, w_scale, b, out, n, splits, out.stride(0), HAS_BIAS=has_bias,
            BLOCK_M=block_m, BLOCK=1024, num_warps=4)
    return out


FUSED_MAX_ROWS = 16  # every program reads its rows' whole K for the scales: few rows only
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split counts, one a column tile, zero between launches (the last program of
    a tile puts its count back): allocated once a device, outside any graph capture
    (the first, eager, step allocates it)."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < tiles:
        have = _COUNTERS[device] = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32,
                                               device=device)
    return have


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, num_sms: int) -> torch.Tensor | None:
    """y (M, N) = fp8.quantize_rows(x) times the e4m3 weight (N, K) with its scales
    (1, N), as quantize_rows_fp8 then fp8_gemm compute it (the same codes and scales,
    the same split sums in the same order), in one launch: for x (M, K) in the output
    dtype with M <= FUSED_MAX_ROWS. None where it does not take the input."""
    m, k = x.shape
    n = weight.shape[0]
    if (m == 0 or m > FUSED_MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1
            or weight.stride(1) != 1 or not w_scale.is_contiguous()
            or bias is not None and not bias.is_contiguous()):
        return None
    splits, per_split = splits_for(n, k, num_sms)
    tiles = triton.cdiv(n, BLOCK_N)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((splits, 16, n), dtype=torch.float32, device=x.device) \
        if splits > 1 else out
    count = _counters(x.device, tiles) if splits > 1 else w_scale
    _fp8_gemm_kernel[(tiles, splits)](
        x, weight, w_scale, w_scale, w_scale if bias is None else bias, out, part, count, m,
        n, k, per_split, x.stride(0), weight.stride(0), out.stride(0), QUANTIZE=True,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, BLOCK_M=16, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K, num_warps=4, num_stages=3)
    return out


def compile_specs(dtype: str) -> list[KernelSpec]:
    """Every variant fp8_gemm launches for outputs of `dtype` ("bf16", "fp16"): 16, 32
    and 64 rows, K split or not, and the split reduce; and fp8_linear's, K split or
    not (sm_89+: e4m3 tensor cores)."""
    i32 = "i32"

    def sig(x: str) -> dict[str, str]:
        return {"x_ptr": x, "w_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "ws_ptr": "*fp32",
                "bias_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "part_ptr": "*fp32",
                "count_ptr": "*fp32" if x == "*fp8e4nv" else "*i32",
                **dict.fromkeys(["m", "n", "k", "tiles_per_split", "stride_x", "stride_w",
                                 "stride_out"], i32),
                **dict.fromkeys(["QUANTIZE", "HAS_BIAS", "SPLIT", "BLOCK_M", "BLOCK_N",
                                 "BLOCK_K"], "constexpr")}

    reduce_sig = {"part_ptr": "*fp32", "xs_ptr": "*fp32", "ws_ptr": "*fp32",
                  "bias_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
                  **dict.fromkeys(["n", "splits", "stride_out"], i32),
                  **dict.fromkeys(["HAS_BIAS", "BLOCK_M", "BLOCK"], "constexpr")}
    options = {"num_warps": 4, "num_stages": 3}
    specs = [KernelSpec(f"fp8_gemm_m{m}" + ("_split" if split else ""), _fp8_gemm_kernel,
                        sig("*fp8e4nv"),
                        {"QUANTIZE": False, "HAS_BIAS": False, "SPLIT": split, "BLOCK_M": m,
                         "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K}, options, dots=1, min_cc=89)
             for m in (16, 32, 64) for split in (False, True)]
    specs += [KernelSpec("fp8_linear" + ("_split" if split else ""), _fp8_gemm_kernel,
                         sig(f"*{dtype}"),
                         {"QUANTIZE": True, "HAS_BIAS": False, "SPLIT": split, "BLOCK_M": 16,
                          "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K}, options, dots=1, min_cc=89)
              for split in (False, True)]
    specs.append(KernelSpec("fp8_gemm_reduce", _fp8_gemm_reduce, reduce_sig,
                            {"HAS_BIAS": False, "BLOCK_M": 16, "BLOCK": 1024},
                            {"num_warps": 4}, min_cc=89))
    return specs
