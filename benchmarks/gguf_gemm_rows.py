"""gpu_check.py's rows for the GGUF-block linears (triton_gguf_gemm, issue 63 item 3).

At Llama-3-8B Q4_K_M shapes (random blocks with sane scales: any bit pattern is a
block), each type/shape gets: its error against the `gguf` package's dequantization
times the same activations, its batch-1 bandwidth on the quantized bytes held against
the measured copy bandwidth (target >= 70%), its speed-up over the bf16 matmul
of the dequantized weight (bf16 reads 16 bits a weight; Q4_K 4.5, Q6_K 6.56, Q8_0
8.5, Q4_0 4.5), and a 512-row prompt's matmul without a float copy (the blocks
dequantized for the call) against the same matmul on a kept copy. Each row is guarded on its own. `--smoke`: tiny shapes, fp32, the
interpreter.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import torch

# type -> (block bytes, {offset of an fp16 scale: a value giving weights of order 0.1})
SCALES = {"Q8_0": (34, {0: 0.1 / 127}), "Q4_0": (18, {0: 0.1 / 8}),
          "Q4_K": (144, {0: 0.15 / (63 * 15), 2: 0.15 / (63 * 15)}),
          "Q6_K": (210, {208: 0.15 / (128 * 32)})}
# (linear, N, K, type): Q4_K_M writes most linears Q4_K, half the layers' down and v
# projections and the LM head Q6_K; Q8_0 and Q4_0 at the widest shape
GPU_CASES = [("gate_up", 28672, 4096, "Q4_K"), ("qkv", 6144, 4096, "Q4_K"),
             ("down", 4096, 14336, "Q4_K"), ("down", 4096, 14336, "Q6_K"),
             ("gate_up", 28672, 4096, "Q8_0"),
             ("gate_up", 28672, 4096, "Q4_0")]
PROMPT_ROWS = 512  # a prompt chunk: past MAX_ROWS, on the dense weight
SMOKE_CASES = [("gate_up", 96, 512, "Q4_K"), ("down", 64, 768, "Q6_K"),
               ("gate_up", 96, 512, "Q8_0"), ("gate_up", 96, 512, "Q4_0")]


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 (n, bytes per row) of random blocks with sane fp16 scales."""
    block_bytes, scales = SCALES[qtype]
    qk = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n * k // qk, block_bytes), dtype=np.uint8)
    for offset, value in scales.items():
        blocks[:, offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return blocks.reshape(n, k // qk * block_bytes)


def add_rows(check: Any, row: type) -> None:
    """Append each case's rows to `check.rows` (gpu_check.Check), one guard per case."""
    cases = GPU_CASES if check.device.type == "cuda" else SMOKE_CASES
    for linear, n, k, qtype in cases:
        check.guarded(f"gguf: {qtype} {linear} {n}x{k}",
                      lambda a=(linear, n, k, qtype): _case(check, row, *a))
        check.free()  # the case's weights went with its frame


def _case(check: Any, row: type, linear: str, n: int, k: int, qtype: str) -> None:
    from tokenmill.kernels import triton_gguf_gemm

    device = check.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    blocks = random_blocks(qtype, n, k)
    w = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]))
    q = torch.from_numpy(blocks).to(device)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(n)).to(device, dtype)
    w_dense = w.to(device, dtype)
    del w
    got = triton_gguf_gemm.gguf_gemm(x, q, qtype, k)
    want = x.float() @ w_dense.float().t()
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    name = f"gguf {qtype} {linear} {n}x{k}"
    check.rows.append(row("gguf", f"{name} vs gguf dequantization (batch 1)", f"{err:.1e}",
                          "max abs / max", floor="< 2e-2"))
    iters = 50 if device.type == "cuda" else 2
    s = check.seconds(lambda: triton_gguf_gemm.gguf_gemm(x, q, qtype, k), iters)
    s_bf16 = check.seconds(lambda: x @ w_dense.t(), iters)
    gb_s = q.numel() / s / 1e9
    check.rows.append(row(
        "gguf", f"{name} batch 1", float(f"{gb_s:.4g}"), "GB/s on blocks",
        floor=f"{check.bandwidth_gb_s:.0f} GB/s copy", vs_floor=f"{gb_s / check.bandwidth_gb_s:.1%}"
        " (target >= 70%)", note=f"{s * 1e6:.1f} us, {q.numel() / 2**20:.1f} MiB"))
    check.rows.append(row("gguf", f"{name} vs bf16 matmul at batch 1",
                          float(f"{s_bf16 / s:.3g}"),
                          "x faster", note=f"bf16 {s_bf16 * 1e6:.1f} us, "
                          f"{w_dense.numel() * w_dense.element_size() / 2**20:.1f} MiB"))
    # a prompt's rows without a float copy (--batched-linears none, auto past 1 GiB):
    # the blocks dequantized into a scratch weight, then the same matmul
    xp = torch.randn(PROMPT_ROWS, k, generator=torch.Generator().manual_seed(k)).to(device,
                                                                                  dtype)

    def no_copy() -> torch.Tensor:
        scratch = torch.empty((n, k), dtype=dtype, device=device)
        triton_gguf_gemm.dequantize(q, qtype, k, scratch)
        return xp @ scratch.t()

    s_nc = check.seconds(no_copy, iters)
    s_copy = check.seconds(lambda: xp @ w_dense.t(), iters)
    check.rows.append(row("gguf", f"{name} {PROMPT_ROWS} prompt rows, no float copy vs a copy",
                          float(f"{s_copy / s_nc:.3g}"), "x the copy's speed",
                          note=f"dequantize + matmul {s_nc * 1e6:.1f} us, the copy's matmul "
                          f"{s_copy * 1e6:.1f} us"))
    if device.type == "cuda":  # a decode batch: the tensor-core tile's rows
        x16 = torch.randn(16, k, device=device, dtype=dtype)
        s16 = check.seconds(lambda: triton_gguf_gemm.gguf_gemm(x16, q, qtype, k), iters)
        s16_bf16 = check.seconds(lambda: x16 @ w_dense.t(), iters)
        check.rows.append(row("gguf", f"{name} vs bf16 matmul at batch 16",
                              float(f"{s16_bf16 / s16:.3g}"), "x faster",
                              note=f"{s16 * 1e6:.1f} vs {s16_bf16 * 1e6:.1f} us"))
