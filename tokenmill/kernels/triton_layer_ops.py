"""layer_ops.c's fused per-layer steps as Triton kernels, for CUDA tensors.

Without them a CUDA decode step is the model's plain torch ops: RMSNorm with its
residual add is nine kernels, rotary six, SiLU * up two, and fp8's per-token
activation scales eight per linear. At batch 1 each is a few microseconds of a
GPU that moves 4 TB/s, so a Llama-3-8B step (32 layers) spent about as long in
these ~1,000 small kernels as in reading its 15 GB of weights (gpu_check.py on
an H200: 6.4 ms against a 3.5 ms floor). Here each is one kernel, computing
what the torch ops compute (in fp32, rounded to the activation dtype where they
round), so the two paths agree to the last bit up to the order of a row's sum.

layer_ops.py calls these for CUDA tensors; they run on CPU tensors only under
the Triton interpreter (TRITON_INTERPRET=1: the tests), where bf16 and fp8
casts truncate instead of rounding to nearest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.spec import KernelSpec

_FP8_MAX = tl.constexpr(448.0)  # torch.finfo(torch.float8_e4m3fn).max
_MAX_ROW_BLOCK = 16384  # one program holds a whole row up to this width


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_out, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # grid: (rows,); the whole row in one program
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # residual <- x + residual, rounded to the activation dtype
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_res + cols, mask=mask,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_res + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)  # HF: normalise in fp32, round, scale
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """layer_ops.rms_norm's contract: weight * norm(x), or residual <- x + residual (in
    place) and the norm of that written over x. None if the kernel does not take it."""
    hidden = x.shape[-1]
    block = triton.next_power_of_2(hidden)
    if (block > _MAX_ROW_BLOCK or not x.is_contiguous() or weight.dtype != x.dtype
            or residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                         or not residual.is_contiguous())):
        return None
    x2 = x.view(-1, hidden)
    res2 = None if residual is None else residual.view(-1, hidden)
    out = x2 if res2 is not None else torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2 if res2 is None else res2, weight, out, x2.stride(0),
            0 if res2 is None else res2.stride(0), out.stride(0), hidden, eps,
            HAS_RESIDUAL=res2 is not None, BLOCK=block, num_warps=_warps(block))
    return x if residual is not None else out.view(x.shape)


@triton.jit
def rotate_in_place(lo_ptr, mask, pos, cos_ptr, sin_ptr, d, HALF: tl.constexpr):
    """The heads at lo_ptr (a tile of heads x the first HALF of each) rotated at pos:
    x * cos + roll(x, half) * sin in fp32, stored back in the activations' dtype;
    returns the two rotated halves (rotary_store.py writes them into the pool too)."""
    lo = tl.load(lo_ptr, mask=mask, other=0.0)
    hi = tl.load(lo_ptr + HALF, mask=mask, other=0.0)
    # the tables' halves: cos = [c | c], sin = [-s | s]
    cos_lo = tl.load(cos_ptr + pos * (2 * HALF) + d)
    cos_hi = tl.load(cos_ptr + pos * (2 * HALF) + HALF + d)
    sin_lo = tl.load(sin_ptr + pos * (2 * HALF) + d)
    sin_hi = tl.load(sin_ptr + pos * (2 * HALF) + HALF + d)
    lo32 = lo.to(tl.float32)
    hi32 = hi.to(tl.float32)
    new_lo = (lo32 * cos_lo + hi32 * sin_lo).to(lo.dtype)
    new_hi = (hi32 * cos_hi + lo32 * sin_hi).to(lo.dtype)
    tl.store(lo_ptr, new_lo, mask=mask)
    tl.store(lo_ptr + HALF, new_hi, mask=mask)
    return new_lo, new_hi


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    # grid: (tokens,); every head of one token rotated in place
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    rotate_in_place(x_ptr + t * stride_t + h * stride_h + d, h < heads, pos, cos_ptr, sin_ptr,
                    d, HALF)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> bool:
    """layer_ops.rotary_'s contract: x (T, heads, D) rotated in place at `positions`
    with fp32 tables (max_pos, D); False (x untouched) if the kernel does not take it."""
    tokens, heads, d = x.shape
    if (d % 2 or d & (d - 1) or x.stride(2) != 1 or positions.dtype != torch.int64
            or positions.dim() != 1 or positions.stride(0) != 1
            or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.shape[1] != d
            or not positions.device == cos.device == sin.device == x.device):
        return False
    if tokens:
        block_h = triton.next_power_of_2(heads)
        _rotary_kernel[(tokens,)](x, positions, cos, sin, x.stride(0), x.stride(1), heads,
                                  HALF=d // 2, BLOCK_H=block_h,
                                  num_warps=_warps(block_h * d))
    return True


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, inter, BLOCK: tl.constexpr):
    # grid: (rows, cdiv(inter, BLOCK))
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)  # F.silu, rounded as torch rounds it
    tl.store(out_ptr + row * stride_out + cols,
             (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up (..., 2 * inter) = [gate | up]; None if not taken."""
    if gate_up.stride(-1) != 1 or gate_up.shape[-1] % 2:
        return None
    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter)
    out = gate_up.new_empty((rows.shape[0], inter))
    if rows.shape[0]:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows, out, rows.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], inter)


@triton.jit
def _fp8_rows_kernel(x_ptr, codes_ptr, scale_ptr, rows, stride_x, stride_codes, n,
                     BLOCK: tl.constexpr):
    # grid: (padded rows,); rows past `rows` are padding: zero codes, scale 1
    row = tl.program_id(0).to(tl.int64)
    live = row < rows
    n_live = tl.where(live, n, 0)  # the columns read: none in a padding row
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_live, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / _FP8_MAX, 1e-12)  # an all-zero row keeps scale > 0
    tl.store(scale_ptr + row, tl.where(live, scale, 1.0))
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_live, other=0.0)
        q = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -_FP8_MAX), _FP8_MAX)
        tl.store(codes_ptr + row * stride_codes + cols, q.to(codes_ptr.dtype.element_ty),
                 mask=cols < n)


def quantize_rows_fp8(x: torch.Tensor, row_multiple: int = 1,
                      codes_dtype: torch.dtype = torch.float8_e4m3fn
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """fp8.quantize_rows in one kernel: x (R, C) -> e4m3 codes and float32 scales
    (rows, 1), rows = R rounded up to `row_multiple` (the extra rows zero codes, scale
    1: what _scaled_mm's padding needs). None if not taken. `codes_dtype` float32
    keeps the clamped values before the cast (the tests: the interpreter's e4m3 cast
    is wrong)."""
    if x.dim() != 2 or x.stride(1) != 1:
        return None
    r, c = x.shape
    rows = -(-r // row_multiple) * row_multiple
    codes = torch.empty((rows, c), dtype=codes_dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = min(2048, triton.next_power_of_2(c))
        _fp8_rows_kernel[(rows,)](x, codes, scale, r, x.stride(0), codes.stride(0), c,
                                  BLOCK=block, num_warps=_warps(block))
    return codes, scale


def compile_specs(dtype: str, head_dim: int, hidden: int = 4096, heads: int = 40
                  ) -> list[KernelSpec]:
    """The variants a Llama-3-8B-shaped step launches (hidden 4096, 32 + 8 q/k heads)
    for activations of `dtype` ("bf16", "fp16") and head_dim, as the wrappers launch
    them: compile_check builds them for sm_80/sm_90 with no GPU."""
    ptr, i32 = f"*{dtype}", "i32"
    block = triton.next_power_of_2(hidden)
    norm_sig = {"x_ptr": ptr, "res_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr,
                **dict.fromkeys(["stride_x", "stride_res", "stride_out", "n"], i32),
                "eps": "fp32", "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr"}
    rotary_sig = {"x_ptr": ptr, "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                  **dict.fromkeys(["stride_t", "stride_h", "heads"], i32),
                  "HALF": "constexpr", "BLOCK_H": "constexpr"}
    silu_sig = {"gu_ptr": ptr, "out_ptr": ptr,
                **dict.fromkeys(["stride_gu", "stride_out", "inter"], i32),
                "BLOCK": "constexpr"}
    fp8_sig = {"x_ptr": ptr, "codes_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
               **dict.fromkeys(["rows", "stride_x", "stride_codes", "n"], i32),
               "BLOCK": "constexpr"}
    block_h = triton.next_power_of_2(heads)
    fp8_block = min(2048, block)
    return [
        *(KernelSpec("rms_norm" + ("_add" if res else ""), _rms_norm_kernel, norm_sig,
                     {"HAS_RESIDUAL": res, "BLOCK": block}, {"num_warps": _warps(block)})
          for res in (False, True)),
        KernelSpec("rotary", _rotary_kernel, rotary_sig,
                   {"HALF": head_dim // 2, "BLOCK_H": block_h},
                   {"num_warps": _warps(block_h * head_dim)}),
        KernelSpec("silu_mul", _silu_mul_kernel, silu_sig, {"BLOCK": 1024}, {"num_warps": 4}),
        KernelSpec("fp8_rows", _fp8_rows_kernel, fp8_sig, {"BLOCK": fp8_block},
                   {"num_warps": _warps(fp8_block)}, min_cc=89),
    ]
