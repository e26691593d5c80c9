"""bf16/fp16 linears at decode batch sizes, with the step that feeds them fused in.

At batch 1 a CUDA step's linears are cuBLAS(Lt) GEMMs: for the narrow qkv and o
projections it picks split-K, a second kernel a linear, and before each of qkv
and gate_up the RMSNorm (with its residual add) is a kernel of its own, as is
SiLU * up before down (gpu_check.py --profile on an H200, Llama-3-8B shapes).
Each of those kernels is a launch and a tail on a GPU that reads a layer's
weights in ~100 us. Here one kernel reads the weight once, (BLOCK_N, BLOCK_K)
tiles `tl.dot`ted with the step's rows (up to MAX_ROWS, padded to 16), and
computes its input in the prologue:

  PLAIN    x
  NORM     weight * norm(x)                       (the first layer's input norm)
  ADD_NORM weight * norm(x + residual); program 0 also writes x + residual out
  SILU_MUL silu(gate) * up, from gate_up = [gate | up]

Each program needs the whole row's sum of squares before its first tile, so the
norms read the row twice (a pass for the sum, then the tiles); the row is a few
KiB that L2 serves, against the (BLOCK_N, K) weight slice each program streams.
The values are what triton_layer_ops' kernels compute (fp32, rounded to the
activation dtype where they round), then multiplied in fp32 on tensor cores:
the same numbers as the separate kernels and F.linear up to the order of sums.
The new residual goes to a fresh tensor, not over `residual` in place, since
every program reads `residual`. On a GPU it takes bf16 and fp16 (fp32 stays on
cuBLAS, as tl.dot would round it to tf32); fp32 runs under the interpreter (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import layer_ops
from tokenmill.kernels.spec import KernelSpec

PLAIN, NORM, ADD_NORM, SILU_MUL = 0, 1, 2, 3
MAX_ROWS = 16  # one tensor-core tile of rows; larger batches stay on cuBLAS
BLOCK_M = 16
BLOCK_K = 128
BLOCK_NS = (64, 32, 16)  # the widest that still gives every SM a program
DEFAULT_SMS = 132  # an H100's, for CPU tensors (the interpreter)


@triton.jit
def _decode_linear_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr,
                          m, n, k, stride_x, stride_res, stride_w, stride_out, eps,
                          PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    # grid: (cdiv(n, BLOCK_N),); rows past m load as zeros and are not stored
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < m
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    res_rows = res_ptr + rows.to(tl.int64)[:, None] * stride_res
    rstd = tl.zeros([BLOCK_M], tl.float32)
    m_out = tl.where(pid == 0, m, 0)  # the rows whose residual this program writes
    if PROLOGUE == 1 or PROLOGUE == 2:  # the row's sum of squares, first
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (ks < k)[None, :]
            h = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
            if PROLOGUE == 2:  # the residual stream's next value, in the activation dtype
                h = (h.to(tl.float32) + tl.load(res_rows + ks[None, :], mask=mask,
                                                other=0.0).to(tl.float32)).to(h.dtype)
                tl.store(res_out_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :],
                         h, mask=(rows < m_out)[:, None] & (ks < k)[None, :])
            h32 = h.to(tl.float32)
            ss += tl.sum(h32 * h32, axis=1)
        rstd = tl.rsqrt(ss / k + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        mask = row_ok[:, None] & k_ok[None, :]
        a = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
        if PROLOGUE == 2:
            a = (a.to(tl.float32) + tl.load(res_rows + ks[None, :], mask=mask,
                                            other=0.0).to(tl.float32)).to(a.dtype)
        if PROLOGUE == 1 or PROLOGUE == 2:  # HF: normalise in fp32, round, scale, round
            normed = (a.to(tl.float32) * rstd[:, None]).to(a.dtype).to(tl.float32)
            nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = (nw[None, :] * normed).to(a.dtype)
        if PROLOGUE == 3:  # x is [gate | up], each k wide
            up = tl.load(x_rows + k + ks[None, :], mask=mask, other=0.0)
            g32 = a.to(tl.float32)
            act = (g32 / (1.0 + tl.exp(-g32))).to(a.dtype)  # F.silu, rounded as torch does
            a = (act.to(tl.float32) * up.to(tl.float32)).to(a.dtype)
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_n(n: int, num_sms: int) -> int:
    """The widest column tile that still gives each SM a program (the narrowest tile
    when none does): o_proj's 4,096 columns on 132 SMs get 16, gate_up's 28,672 get 64."""
    for b in BLOCK_NS:
        if triton.cdiv(n, b) >= num_sms:
            return b
    return BLOCK_NS[-1]


def _launch(prologue: int, x: torch.Tensor, k: int, weight: torch.Tensor,
            bias: torch.Tensor | None, residual: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0
            ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    n = weight.shape[0]
    m = x.shape[0]
    if x.is_cuda and x.dtype not in (torch.bfloat16, torch.float16):
        return None  # fp32 stays on cuBLAS: tl.dot would round its inputs to tf32
    if (x.dim() != 2 or m == 0 or m > MAX_ROWS or weight.dim() != 2 or weight.shape[1] != k
            or weight.dtype != x.dtype or weight.stride(1) != 1 or x.stride(1) != 1
            or bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous())
            or norm_weight is not None and (norm_weight.dtype != x.dtype
                                            or not norm_weight.is_contiguous())
            or residual is not None and (residual.shape != x.shape
                                         or residual.dtype != x.dtype
                                         or residual.stride(1) != 1)):
        return None
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = None if prologue != ADD_NORM else \
        torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)  # x's rows
    bn = block_n(n, layer_ops.num_sms(x.device) if x.is_cuda else DEFAULT_SMS)
    _decode_linear_kernel[(triton.cdiv(n, bn),)](
        x, x if residual is None else residual, weight if norm_weight is None else norm_weight,
        weight, weight if bias is None else bias, out, x if res_out is None else res_out,
        m, n, k, x.stride(0), 0 if residual is None else residual.stride(0), weight.stride(0),
        out.stride(0), eps, PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M,
        BLOCK_N=bn, BLOCK_K=BLOCK_K, num_warps=4, num_stages=4)
    return out, res_out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
           ) -> torch.Tensor | None:
    """F.linear(x, weight, bias) for x (M, K), M <= MAX_ROWS; None if not taken."""
    done = _launch(PLAIN, x, x.shape[-1], weight, bias)
    return None if done is None else done[0]


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(linear(norm(r)), r) with r = x + residual (x itself when residual is None):
    RMSNorm.add_forward then the linear, in one kernel; `residual` is not written.
    None if not taken."""
    prologue = NORM if residual is None else ADD_NORM
    done = _launch(prologue, x, x.shape[-1], weight, bias, residual, norm_weight, eps)
    if done is None:
        return None
    y, res_out = done
    return y, x if res_out is None else res_out


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> torch.Tensor | None:
    """linear(silu(gate) * up) for gate_up (M, 2 * inter) = [gate | up]; None if not
    taken."""
    if gate_up.shape[-1] % 2:
        return None
    done = _launch(SILU_MUL, gate_up, gate_up.shape[-1] // 2, weight, bias)
    return None if done is None else done[0]


def compile_specs(dtype: str) -> list[KernelSpec]:
    """Every variant the wrappers launch for activations of `dtype` ("bf16", "fp16"):
    each prologue at each column tile (bias on: Qwen2's qkv; the same code otherwise)."""
    ptr, i32 = f"*{dtype}", "i32"
    sig = {"x_ptr": ptr, "res_ptr": ptr, "nw_ptr": ptr, "w_ptr": ptr, "b_ptr": ptr,
           "out_ptr": ptr, "res_out_ptr": ptr,
           **dict.fromkeys(["m", "n", "k", "stride_x", "stride_res", "stride_w",
                            "stride_out"], i32),
           "eps": "fp32",
           **dict.fromkeys(["PROLOGUE", "HAS_BIAS", "BLOCK_M", "BLOCK_N", "BLOCK_K"],
                           "constexpr")}
    names = {PLAIN: "plain", NORM: "norm", ADD_NORM: "add_norm", SILU_MUL: "silu_mul"}
    return [KernelSpec(f"decode_linear_{names[p]}_n{bn}", _decode_linear_kernel, sig,
                       {"PROLOGUE": p, "HAS_BIAS": p == ADD_NORM, "BLOCK_M": BLOCK_M,
                        "BLOCK_N": bn, "BLOCK_K": BLOCK_K},
                       {"num_warps": 4, "num_stages": 4}, dots=1)
            for p in names for bn in BLOCK_NS]
