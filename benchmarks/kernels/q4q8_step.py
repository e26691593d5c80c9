"""One decode step's linears on gguf-a16's kernel (q4q8_gemv.c), at a range of rows.

SmolLM2-135M's shapes: per layer qkv (576 -> 960), o (576 -> 576), gate_up
(576 -> 3072) and down (1536 -> 576), 30 layers, and the Q8_0 LM head (576 -> 49,152),
each with its own random records (~100 MB: weights come from memory, as in a step),
in one huge-page mapping as the engine keeps them (`--no-huge-pages`: each its own
allocation), activations quantized to 16 bits as the default path does. Prints the step's time and
multiply-adds per second at each row count; `--bits 8` for gguf-a8; `--gemm16` runs the
many-rows path instead (tm_q4q8_gemm16: on AVX2 the records widened to int16 a few
groups at a time, the same bits), what prompts and 12+-row decode steps take there.

    python -m benchmarks run q4q8-step [--rows 1,8,16,32,64] [--repeats 5] [--gemm16]
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill.kernels import q4q8_gemv
from tokenmill.quant import huge_pages

SHAPES = [(576, 960, q4q8_gemv.FORMAT_Q4), (576, 576, q4q8_gemv.FORMAT_Q4),
          (576, 3072, q4q8_gemv.FORMAT_Q4), (1536, 576, q4q8_gemv.FORMAT_Q4)]
LM_HEAD = (576, 49152, q4q8_gemv.FORMAT_Q8)


def records(k: int, n: int, fmt: int, gen: torch.Generator) -> torch.Tensor:
    """Random records of the packed layout: codes, then fp16 scales (and Q4's minima)."""
    groups, blocks = -(-n // q4q8_gemv.ROWS), k // 32
    code_bytes = 256 if fmt == q4q8_gemv.FORMAT_Q4 else 512
    scales = 32 if fmt == q4q8_gemv.FORMAT_Q4 else 16
    codes = torch.randint(0, 256, (groups, blocks, code_bytes), dtype=torch.uint8,
                          generator=gen)
    half = (torch.rand((groups, blocks, scales), generator=gen) * 0.02).half()
    return torch.cat([codes, half.view(torch.uint8)], -1).contiguous().view(-1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bits", type=int, default=16, choices=q4q8_gemv.BITS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--gemm16", action="store_true", help="tm_q4q8_gemm16 (16-bit only)")
    args = ap.parse_args(argv)
    if args.gemm16 and args.bits != 16:
        raise SystemExit("--gemm16 runs 16-bit activations only")
    torch.set_num_threads(args.threads)
    if not q4q8_gemv.available():
        raise SystemExit("q4q8_gemv did not build here (no C compiler, or TOKENMILL_NATIVE=0)")
    gen = torch.Generator().manual_seed(0)
    step = SHAPES * 30 + [LM_HEAD]
    weights = [records(k, n, f, gen) for k, n, f in step]
    if args.huge_pages:
        weights = huge_pages.gather(weights) or weights
    macs = sum(k * n for k, n, _ in step)
    print(f"q4q8 kernel, one decode step's linears ({len(step)} calls, {macs / 1e6:.0f} M "
          f"multiply-adds a row), {args.bits}-bit activations, {args.threads} threads, "
          f"dot products {q4q8_gemv.isa()}, huge pages {args.huge_pages}"
          + (", gemm16" if args.gemm16 else ""))
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn((rows, k), generator=gen).bfloat16() for k, _, _ in step]

        if args.gemm16:
            calls = [lambda x, w, n=n, fmt=fmt: q4q8_gemv.gemm16(x, w, n, fmt)
                     for _, n, fmt in step]
        else:  # as the model's decode steps call it
            calls = [q4q8_gemv.bind(k, n, fmt, args.bits) for k, n, fmt in step]
        times = []
        for i in range(args.repeats + 1):  # the first pass warms up
            t0 = time.perf_counter()
            for call, w, x in zip(calls, weights, xs, strict=True):
                call(x, w)
            if i:
                times.append(time.perf_counter() - t0)
        best = min(times)
        print(f"rows {rows:4d}: best {best * 1e3:7.2f} ms, median "
              f"{sorted(times)[len(times) // 2] * 1e3:7.2f} ms, {macs * rows / best / 1e9:6.1f} "
              "G multiply-adds/s")


if __name__ == "__main__":
    main()
