"""GGUF-quantized linears on the GPU: y = x . W^T with W read as its GGUF blocks.

Dequantizing a GGUF file to bf16 at load reads four times the bytes a Q4_K_M
decode step needs (4.5 bits a weight against 16), and vLLM's GGUF path is
known to be slow on GPUs. Here the weight stays as the file's blocks, uint8
(N, bytes_per_row), and each program dequantizes a (BLOCK_N, 256) tile in
registers and `tl.dot`s it with the rows of x (padded to 16..64): at decode
batch sizes the step is bandwidth-bound, so the bytes read are what counts.

Block layouts (llama.cpp's ggml-common.h, the `gguf` package's quants.py):
  Q8_0  34 bytes / 32:  d fp16, qs int8[32]                     w = d*q
  Q4_0  18 bytes / 32:  d fp16, qs u8[16] (lo nibbles 0-15, hi 16-31)  w = d*(q-8)
  Q4_K 144 bytes / 256: d, dmin fp16, scales u8[12] (8 6-bit scale/min pairs),
        qs u8[128] (4 chunks of 32 bytes: lo nibbles 64j..64j+31, hi the next 32)
        w = d*sc*q - dmin*m
  Q6_K 210 bytes / 256: ql u8[128], qh u8[64], scales i8[16], d fp16
        w = d*sc*(q-32), q = 4 low bits from ql | 2 high bits from qh
Every element's bytes are computed from its index (gathers within the row's
block, which the L1 serves), one code path per type chosen at compile time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.spec import KernelSpec

# type name -> (QTYPE constexpr, elements per block, bytes per block)
TYPES = {"Q8_0": (0, 32, 34), "Q4_0": (1, 32, 18), "Q4_K": (2, 256, 144),
         "Q6_K": (3, 256, 210)}
BLOCK_N = 32
BLOCK_K = 256  # a K-quant super-block, or 8 blocks of the 32-element types
MAX_ROWS = 64


@triton.jit
def _half(ptr, off, mask):
    lo = tl.load(ptr + off, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + off + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr, off, mask):
    return tl.load(ptr + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _dequant_tile(w_ptr, cols, ks, row_bytes, n, k, QTYPE: tl.constexpr, QK: tl.constexpr,
                  BB: tl.constexpr):
    # (BLOCK_N, BLOCK_K) float32 weights of columns `cols`, elements `ks` of K
    ok = (cols < n)[:, None] & (ks < k)[None, :]
    base = cols.to(tl.int64)[:, None] * row_bytes + ((ks // QK) * BB)[None, :]
    e = (ks % QK)[None, :]
    if QTYPE == 0:  # Q8_0
        d = _half(w_ptr, base, ok)
        q = tl.load(w_ptr + base + 2 + e, mask=ok, other=0).to(tl.int8, bitcast=True)
        w = d * q.to(tl.float32)
    elif QTYPE == 1:  # Q4_0
        d = _half(w_ptr, base, ok)
        byte = _byte(w_ptr, base + 2 + e % 16, ok)
        w = d * (((byte >> ((e // 16) * 4)) & 0xF) - 8).to(tl.float32)
    elif QTYPE == 2:  # Q4_K
        d = _half(w_ptr, base, ok)
        dmin = _half(w_ptr, base + 2, ok)
        j = e // 64
        hi = (e // 32) % 2
        q = (_byte(w_ptr, base + 16 + 32 * j + e % 32, ok) >> (4 * hi)) & 0xF
        s = 2 * j + hi  # which of the 8 scale/min pairs (get_scale_min_k4)
        low = s < 4
        a = _byte(w_ptr, base + 4 + s % 4 + tl.where(low, 0, 8), ok)  # scales[s] / [s+4]
        b = _byte(w_ptr, base + 4 + s % 4 + 4, ok)  # scales[s+4] / [s]
        c = _byte(w_ptr, base + 4 + s % 4, ok)  # scales[s-4] when s >= 4
        sc = tl.where(low, a & 63, (a & 0xF) | ((c >> 6) << 4))
        m = tl.where(low, b & 63, (a >> 4) | ((b >> 6) << 4))
        w = d * sc.to(tl.float32) * q.to(tl.float32) - dmin * m.to(tl.float32)
    else:  # Q6_K
        d = _half(w_ptr, base + 208, ok)
        half = e // 128
        r = e % 128
        quarter = r // 32
        l = r % 32
        ql = _byte(w_ptr, base + 64 * half + l + 32 * (quarter % 2), ok)
        qh = _byte(w_ptr, base + 128 + 32 * half + l, ok)
        q = (((ql >> (4 * (quarter // 2))) & 0xF) | (((qh >> (2 * quarter)) & 3) << 4)) - 32
        sc = tl.load(w_ptr + base + 192 + 8 * half + l // 16 + 2 * quarter, mask=ok,
                     other=0).to(tl.int8, bitcast=True)
        w = d * sc.to(tl.float32) * q.to(tl.float32)
    return w


@triton.jit
def _gguf_gemm_kernel(x_ptr, w_ptr, out_ptr, m, n, k, row_bytes, stride_x, stride_out,
                      QTYPE: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # grid: (cdiv(n, BLOCK_N),); rows past m load as zeros and are not stored
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                    mask=(rows < m)[:, None] & (ks < k)[None, :], other=0.0)
        w = _dequant_tile(w_ptr, cols, ks, row_bytes, n, k, QTYPE, QK, BB)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rows < m)[:, None] & (cols < n)[None, :])


@triton.jit
def _gguf_dequant_kernel(w_ptr, out_ptr, n, k, row_bytes, stride_out, QTYPE: tl.constexpr,
                         QK: tl.constexpr, BB: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    # grid: (cdiv(n, BLOCK_N), cdiv(k, BLOCK_K)): one tile of the dense weight
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    w = _dequant_tile(w_ptr, cols, ks, row_bytes, n, k, QTYPE, QK, BB)
    tl.store(out_ptr + cols.to(tl.int64)[:, None] * stride_out + ks[None, :],
             w.to(out_ptr.dtype.element_ty), mask=(cols < n)[:, None] & (ks < k)[None, :])


def dequantize(blocks: torch.Tensor, qtype: str, k: int, out: torch.Tensor) -> bool:
    """Write the weight of `blocks` (uint8 (N, bytes per row)) into `out` (N, K), a
    float tensor with unit inner stride: for a prompt's rows, which a GEMM on the dense
    weight serves, without a dense copy kept. False (out untouched) if not taken."""
    if qtype not in TYPES:
        return False
    code, qk, bb = TYPES[qtype]
    n = blocks.shape[0]
    if (k % qk or blocks.dtype != torch.uint8 or blocks.shape[1] != k // qk * bb
            or not blocks.is_contiguous() or out.shape != (n, k) or out.stride(1) != 1):
        return False
    if n:
        _gguf_dequant_kernel[(triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))](
            blocks, out, n, k, blocks.shape[1], out.stride(0), QTYPE=code, QK=qk, BB=bb,
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return True


def bytes_per_row(qtype: str, k: int) -> int:
    _, qk, bb = TYPES[qtype]
    return k // qk * bb


def gguf_gemm(x: torch.Tensor, blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor | None:
    """y (M, N) = x (M, K) . W^T for W given as GGUF blocks, uint8 (N, bytes per row).
    None where it does not take the input (a type it lacks, more than MAX_ROWS rows,
    K not whole blocks): the caller then runs its dequantized weight."""
    if qtype not in TYPES or x.dim() != 2 or x.shape[1] != k:
        return None
    code, qk, bb = TYPES[qtype]
    m, n = x.shape[0], blocks.shape[0]
    if (m == 0 or m > MAX_ROWS or k % qk or blocks.dtype != torch.uint8
            or blocks.shape[1] != k // qk * bb or not blocks.is_contiguous()):
        return None
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gguf_gemm_kernel[(triton.cdiv(n, BLOCK_N),)](
        x, blocks, out, m, n, k, blocks.shape[1], x.stride(0), out.stride(0),
        QTYPE=code, QK=qk, BB=bb, BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, num_stages=2)
    return out


def compile_specs(dtype: str) -> list[KernelSpec]:
    """Every variant gguf_gemm launches for activations of `dtype` ("bf16", "fp16"):
    each type at 16 and 64 rows (32 is the same code between them); and dequantize's,
    each type into `dtype`."""
    i32 = "i32"
    sig = {"x_ptr": f"*{dtype}", "w_ptr": "*u8", "out_ptr": f"*{dtype}",
           **dict.fromkeys(["m", "n", "k", "row_bytes", "stride_x", "stride_out"], i32),
           **dict.fromkeys(["QTYPE", "QK", "BB", "BLOCK_M", "BLOCK_N", "BLOCK_K"],
                           "constexpr")}
    dequant_sig = {"w_ptr": "*u8", "out_ptr": f"*{dtype}",
                   **dict.fromkeys(["n", "k", "row_bytes", "stride_out"], i32),
                   **dict.fromkeys(["QTYPE", "QK", "BB", "BLOCK_N", "BLOCK_K"], "constexpr")}
    return [KernelSpec(f"gguf_{name.lower()}_m{rows}", _gguf_gemm_kernel, sig,
                       {"QTYPE": code, "QK": qk, "BB": bb, "BLOCK_M": rows,
                        "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K},
                       {"num_warps": 4, "num_stages": 2}, dots=1)
            for name, (code, qk, bb) in TYPES.items() for rows in (16, 64)] + [
        KernelSpec(f"gguf_{name.lower()}_dequant", _gguf_dequant_kernel, dequant_sig,
                   {"QTYPE": code, "QK": qk, "BB": bb, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K},
                   {"num_warps": 4})
        for name, (code, qk, bb) in TYPES.items()]
