"""Micro-benchmark of one linear layer's kernels at SmolLM2-135M's shapes.

For each shape and batch size (rows): fp32 and bf16 dense matmul, bf16 with the
weight packed once for oneDNN (tokenmill.quant.dense, the large-batch path), int8
(`_weight_int8pack_mm`, per-row scales), int4 (`_weight_int4pack_mm_for_cpu`,
group 32) and the Q8_0 form of int4 (K doubled), all through the modules of
tokenmill.models.quantization, plus each one's bandwidth floor (weight bytes ÷
measured read bandwidth). Each shape is timed over as many distinct weights
as one decode step uses (30 per layer shape, 1 LM head), so weights come from
memory as in a real step, not from a warm cache. The last table sums one
decode step's linears per method: where the low-bit/bf16 cross-over is.

    python -m benchmarks run linear-kernels [--min-run-time 0.2] [--threads 2]
"""

from __future__ import annotations

import argparse
import platform

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

from benchmarks import results
from benchmarks.results import Figure
from tokenmill.quant.codes import int4_codes_from_float, int8_codes_from_float
from tokenmill.quant.dense import DenseWeight
from tokenmill.quant.linear import Int4Linear, Int8Linear

# name -> (in_features, out_features, count per decode step)
SHAPES = {
    "qkv": (576, 960, 30),
    "o": (576, 576, 30),
    "gate_up": (576, 3072, 30),
    "down": (1536, 576, 30),
    "lm_head": (576, 49152, 1),
}
BATCHES = (1, 2, 4, 8, 16, 64)
METHODS = ("fp32", "bf16", "bf16_packed", "int8", "int4", "int4_q8")


def read_bandwidth_bytes_s(min_run_time: float) -> float:
    buf = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, far beyond the caches
    t = Timer("buf.sum()", globals={"buf": buf}).blocked_autorange(min_run_time=min_run_time)
    return buf.numel() * 4 / t.median


class _Packed(torch.nn.Module):
    def __init__(self, dense: DenseWeight) -> None:
        super().__init__()
        self.dense = dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)


def build(method: str, w: torch.Tensor) -> tuple[torch.nn.Module | torch.Tensor, int]:
    """A callable module (or a dense weight) and the bytes it reads per call."""
    n, k = w.shape
    if method == "fp32":
        return w, n * k * 4
    if method == "bf16":
        return w.bfloat16(), n * k * 2
    if method == "bf16_packed":
        return _Packed(DenseWeight(w.bfloat16())), n * k * 2
    if method == "int8":
        codes, scale = int8_codes_from_float(w)
        m = Int8Linear(codes, scale)
        return m, m.lowbit_bytes()
    if method == "int4":
        m4 = Int4Linear(*int4_codes_from_float(w))
        return m4, m4.lowbit_bytes()
    # Q8_0 via the int4 kernel: codes (N, 2K), one (scale, zero) per 32 of them
    codes = torch.randint(0, 16, (n, 2 * k), dtype=torch.uint8)
    scale = torch.rand(n, 2 * k // 32) * 1e-2
    mq = Int4Linear(codes, scale, torch.zeros_like(scale), input_repeats=2)
    return mq, mq.lowbit_bytes()


def time_call(ops: list[torch.nn.Module | torch.Tensor], x: torch.Tensor,
              min_run_time: float) -> float:
    """Median seconds per call, cycling through distinct weights."""
    if isinstance(ops[0], torch.Tensor):
        stmt = "for w in ops: F.linear(x, w)"
        x = x.to(ops[0].dtype)
    else:
        stmt, x = "for m in ops: m(x)", x.bfloat16()
    with torch.inference_mode():
        t = Timer(stmt, globals={"F": F, "x": x, "ops": ops}, num_threads=torch.get_num_threads())
        return t.blocked_autorange(min_run_time=min_run_time).median / len(ops)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-run-time", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-result", action="store_true",
                    help="print only; write no benchmarks/results/ file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bw = read_bandwidth_bytes_s(args.min_run_time)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, "
          f"read bandwidth {bw / 1e9:.1f} GB/s")
    step_us = {(m, b): 0.0 for m in METHODS for b in BATCHES}
    floor_us = dict.fromkeys(METHODS, 0.0)
    header = "shape          batch " + "".join(f"{m:>10}" for m in METHODS)
    print("\nmicroseconds per call (median); floor = weight bytes / read bandwidth")
    print(header)
    for name, (k, n, count) in SHAPES.items():
        weights = [torch.randn(n, k) * 0.02 for _ in range(count)]
        built = {m: [build(m, w) for w in weights] for m in METHODS}
        del weights
        ops = {m: [op for op, _ in built[m]] for m in METHODS}
        floors = {m: built[m][0][1] / bw * 1e6 for m in METHODS}
        for m in METHODS:
            floor_us[m] += floors[m] * count
        print(f"{name:8}{k:>5}x{n:<6} floor" + "".join(f"{floors[m]:10.1f}" for m in METHODS))
        for b in BATCHES:
            x = torch.randn(b, k)
            times = {m: time_call(ops[m], x, args.min_run_time) * 1e6 for m in METHODS}
            for m in METHODS:
                step_us[(m, b)] += times[m] * count
            print(f"{'':14}{b:>6} " + "".join(f"{times[m]:10.1f}" for m in METHODS))
        del built, ops
    print("\none decode step's linears (30 layers x qkv, o, gate_up, down + lm_head), ms;")
    print("int4_q8 column: every linear in the Q8_0 form (for reference only)")
    print("batch " + "".join(f"{m:>10}" for m in METHODS) + "   best")
    print("floor " + "".join(f"{floor_us[m] / 1e3:10.2f}" for m in METHODS))
    for b in BATCHES:
        row = {m: step_us[(m, b)] / 1e3 for m in METHODS}
        best = min(row, key=row.__getitem__)
        print(f"{b:>5} " + "".join(f"{row[m]:10.2f}" for m in METHODS) + f"   {best}")
    if not args.no_result:
        figures = [Figure(m, "tokenmill", f"one decode step's linears, {b} rows", "ms",
                          [step_us[(m, b)] / 1e3], False,
                          {"method": m, "rows": b, "threads": args.threads})
                   for b in BATCHES for m in METHODS]
        results.write(results.build("linear-kernels", "Linear kernels at SmolLM2's shapes",
                                    figures))


if __name__ == "__main__":
    main()
