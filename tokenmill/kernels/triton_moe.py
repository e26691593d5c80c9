"""The routed experts on the GPU as one Triton launch per projection (fused MoE).

The step's T * k (token, expert) pairs are sorted by expert and each expert's
group padded to BLOCK_M rows (`align_pairs`, torch ops, no host sync): every
BLOCK_M block of the sorted list then belongs to one expert. One program per
(block, BLOCK_N output columns) multiplies its rows by that expert's weight
slice, so an expert's weights are read once per block of its tokens and experts
nobody chose are never read: at batch 1 a layer moves k experts' bytes, at batch
64 the union of the chosen ones. Two launches per layer: gate_up (rows of x,
pair // k) and down (rows of the activations, one per pair, times the pair's
routing weight); the k rows of a token are then summed.

Weights are the model's dtype (bf16 / fp16 / fp32) or e4m3 with one float32
scale per (expert, output channel): the codes are widened to the activations'
dtype in registers and the scale applied to the accumulator, so fp8 halves the
bytes moved. (Under the interpreter e4m3 codes travel as float32 holding e4m3
values, as in triton_fp8_gemm: its e4m3 casts are wrong.) vLLM's fused_moe is
the model for this layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels.spec import KernelSpec

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _fused_moe_kernel(a_ptr, w_ptr, scale_ptr, out_ptr, sorted_ptr, expert_ptr, total_ptr,
                      pair_weight_ptr, n, k, num_pairs, top_k, stride_a, stride_we, stride_wn,
                      stride_out, A_PER_PAIR: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                      HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    # grid: (padded blocks, cdiv(n, BLOCK_N)); blocks past the padded total exit at once
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = pairs < num_pairs  # padding slots hold num_pairs
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    if A_PER_PAIR:
        a_rows = pairs
    else:
        a_rows = pairs // top_k
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(a_ptr + a_rows.to(tl.int64)[:, None] * stride_a + ks[None, :],
                    mask=ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + expert * n + cols, mask=col_ok, other=0.0)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(pair_weight_ptr + pairs, mask=ok, other=0.0)[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=ok[:, None] & col_ok[None, :])


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (T, k) -> (sorted pair indices, each expert's group padded to block_m with
    T * k (the padding mark); the expert of each block; the padded total (1,) int32), all
    on ids' device, sized for the worst case so that nothing is read back to the host."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    # scatter_add, not bincount: bincount reads its input's max back to the host, which
    # a CUDA graph capture forbids
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    first_of = torch.cumsum(counts, 0) - counts  # (E,) index of each expert's first pair
    rank = torch.arange(num_pairs, device=ids.device) - first_of[expert_sorted]
    dest = (ends - padded)[expert_sorted] + rank
    slots = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((slots,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[dest] = order.to(torch.int32)
    starts = torch.arange(0, slots, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_expert.to(torch.int32), ends[-1:].to(torch.int32)


def _launch(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor,
            aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int,
            pair_weights: torch.Tensor | None, a_per_pair: bool) -> None:
    sorted_pairs, block_expert, total = aligned
    n, k = w.shape[1], w.shape[2]
    grid = (sorted_pairs.numel() // BLOCK_M, triton.cdiv(n, BLOCK_N))
    _fused_moe_kernel[grid](
        a, w, scale if scale is not None else total, out, sorted_pairs, block_expert, total,
        pair_weights if pair_weights is not None else total, n, k, out.shape[0], top_k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), A_PER_PAIR=a_per_pair,
        MUL_WEIGHT=pair_weights is not None, HAS_SCALE=scale is not None, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, num_stages=3)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, H); w13 (E, 2I, H), w2 (E, H, I) in x's dtype, or e4m3 codes with scales
    (E, 2I) / (E, H) float32; weights, ids (T, k) -> (T, H) in x's dtype: each token's
    sum over its k experts of weight * down(silu(gate(x)) * up(x))."""
    tokens, top_k = ids.shape
    num_pairs = tokens * top_k
    aligned = align_pairs(ids, w13.shape[0])
    gate_up = torch.empty((num_pairs, w13.shape[1]), dtype=x.dtype, device=x.device)
    _launch(x.contiguous(), w13, w13_scale, gate_up, aligned, top_k, None, a_per_pair=False)
    gate, up = gate_up.chunk(2, dim=-1)
    h = (F.silu(gate.float()) * up.float()).to(x.dtype)  # (T * k, I)
    pairs = torch.empty((num_pairs, w2.shape[1]), dtype=x.dtype, device=x.device)
    _launch(h, w2, w2_scale, pairs, aligned, top_k, weights.flatten().float().contiguous(),
            a_per_pair=True)
    return pairs.view(tokens, top_k, -1).sum(dim=1)


def compile_specs(dtype: str) -> list[KernelSpec]:
    """The variants fused_moe launches for activations of `dtype` ("bf16", "fp16"):
    gate_up (rows by token) and down (rows by pair, times the routing weight), with
    weights of that dtype (sm_80+) or e4m3 with per-channel scales (sm_89+)."""
    i32 = "i32"
    specs = []
    for weight, min_cc in ((dtype, 80), ("fp8e4nv", 89)):
        sig = {"a_ptr": f"*{dtype}", "w_ptr": f"*{weight}", "scale_ptr": "*fp32",
               "out_ptr": f"*{dtype}", "sorted_ptr": "*i32", "expert_ptr": "*i32",
               "total_ptr": "*i32", "pair_weight_ptr": "*fp32",
               **dict.fromkeys(["n", "k", "num_pairs", "top_k", "stride_a", "stride_we",
                                "stride_wn", "stride_out"], i32),
               **dict.fromkeys(["A_PER_PAIR", "MUL_WEIGHT", "HAS_SCALE", "BLOCK_M", "BLOCK_N",
                                "BLOCK_K"], "constexpr")}
        for proj, per_pair in (("gate_up", False), ("down", True)):
            specs.append(KernelSpec(
                f"fused_moe_{proj}" + ("_fp8" if weight == "fp8e4nv" else ""),
                _fused_moe_kernel, sig,
                {"A_PER_PAIR": per_pair, "MUL_WEIGHT": per_pair,
                 "HAS_SCALE": weight == "fp8e4nv", "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N,
                 "BLOCK_K": BLOCK_K}, {"num_warps": 4, "num_stages": 3}, dots=1, min_cc=min_cc))
    return specs
