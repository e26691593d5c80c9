"""The integer multiply-add ceiling of this CPU: how many vpmaddwd / vpmaddubsw (AVX2)
and vpdpbusd / vpdpwssd (AVX512-VNNI) the cores issue a second, all threads at once.

gguf-a16's kernels (q4q8_gemv.c) are bound by these instructions once a batch has a few
rows: AVX2's gemm16 multiplies int16 weights by int16 activations, 16 multiply-adds a
vpmaddwd; the VNNI kernel multiplies nibbles by each of the activations' two byte
planes, 64 byte products a vpdpbusd, 32 real multiply-adds. What a linear reaches in
benchmarks run q4q8-step (G multiply-adds/s) reads against the line printed here.

Each thread runs 12 independent chains of the instruction (far more than its latency
needs), in inline assembly, for about half a second, best of 5; the source is written to
a temporary directory and built with the kernels' C compiler (-O2 -march=native
-fopenmp).

    python -m benchmarks run int-peak [--threads 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import results
from benchmarks.results import Figure
from tokenmill.cpuinfo import cpu_flags
from tokenmill.kernels import build

# name, required CPU flags, register kind, instruction text (operands: %1 %2 inputs, %0
# the chain), multiply-adds an instruction does at gguf-a16's 16-bit activations (a byte
# instruction's products count half: the activations' two byte planes)
INSTRUCTIONS = [
    ("vpmaddwd ymm + vpaddd", {"avx2"}, "x",
     "vpmaddwd %1, %2, %%ymm15\\n\\tvpaddd %%ymm15, %0, %0", 16),
    ("vpmaddubsw ymm + vpaddw", {"avx2"}, "x",
     "vpmaddubsw %1, %2, %%ymm15\\n\\tvpaddw %%ymm15, %0, %0", 16),
    ("vfmadd231ps ymm (fp32)", {"avx2", "fma"}, "x", "vfmadd231ps %1, %2, %0", 8),
    ("vpdpbusd zmm", {"avx512_vnni"}, "v", "vpdpbusd %1, %2, %0", 32),
    ("vpdpwssd zmm", {"avx512_vnni"}, "v", "vpdpwssd %1, %2, %0", 32),
]

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
int main(void) {
    const long n = ITERATIONS;
    double best = 1e30;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = 0, t1 = 0;
#pragma omp parallel num_threads(THREADS)
        {
            /* twelve variables, not an array: gcc stored an array's chains to the stack
             * after every instruction, and the stores were the limit */
            VEC a0 = SET1(1), a1 = SET1(2), a2 = SET1(3), a3 = SET1(4), a4 = SET1(5),
                a5 = SET1(6), a6 = SET1(7), a7 = SET1(8), a8 = SET1(9), a9 = SET1(10),
                a10 = SET1(11), a11 = SET1(12), w = SET1(3), x = SET1(5);
#pragma omp barrier
#pragma omp master
            t0 = now();
            for (long i = 0; i < n; i++) {
#define S(v) __asm__ volatile(INSN : "+" REG(v) : REG(w), REG(x) CLOBBER);
                S(a0) S(a1) S(a2) S(a3) S(a4) S(a5) S(a6) S(a7) S(a8) S(a9) S(a10) S(a11)
            }
            volatile VEC sink;
            sink = a0, sink = a1, sink = a2, sink = a3, sink = a4, sink = a5;
            sink = a6, sink = a7, sink = a8, sink = a9, sink = a10, sink = a11;
            (void)sink;
#pragma omp barrier
#pragma omp master
            t1 = now();
        }
        if (t1 - t0 < best) best = t1 - t0;
    }
    printf("%.6f\n", best);
    return 0;
}
"""


def measure(compiler: str, workdir: Path, insn: str, reg: str, threads: int,
            iterations: int) -> float:
    """Seconds for `iterations` x 12 instructions on each of `threads` threads (best of 5)."""
    zmm = reg == "v"
    defs = {
        "ITERATIONS": str(iterations), "THREADS": str(threads),
        "VEC": "__m512i" if zmm else "__m256i",
        "SET1(v)": "_mm512_set1_epi32(0x3f800000 + (v))" if zmm
        else "_mm256_set1_epi32(0x3f800000 + (v))",  # 1.0f and up: no denormal FMAs
        "INSN": f'"{insn}"', "REG(v)": f'"{reg}"(v)',
        "CLOBBER": ': "xmm15"' if "ymm15" in insn else "",
    }
    src = workdir / "peak.c"
    src.write_text("".join(f"#define {k} {v}\n" for k, v in defs.items()) + SOURCE)
    exe = workdir / "peak"
    subprocess.run([compiler, "-O2", "-march=native", "-fopenmp", str(src), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return float(out.strip())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--iterations", type=int, default=100_000_000,
                    help="loop trips a thread (12 instructions each)")
    ap.add_argument("--no-result", action="store_true",
                    help="print only; write no benchmarks/results/ file")
    args = ap.parse_args(argv)
    compiler = build.compiler()
    if compiler is None:
        sys.exit("int_peak.py: no C compiler ($CC, cc or gcc)")
    flags = cpu_flags()
    print(f"integer multiply-add ceiling · {args.threads} threads · CPU flags: "
          f"{', '.join(sorted(f for f in flags if f.startswith(('avx2', 'avx512_vnni', 'fma'))))}")
    figures = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-int-peak-") as tmp:
        for name, need, reg, insn, macs in INSTRUCTIONS:
            if not need <= flags:
                print(f"{name:26s} not on this CPU")
                continue
            seconds = measure(compiler, Path(tmp), insn, reg, args.threads, args.iterations)
            per_thread = 12 * args.iterations / seconds
            print(f"{name:26s} {per_thread / 1e9:6.2f} G a second a thread; "
                  f"{per_thread * args.threads * macs / 1e9:7.1f} G multiply-adds/s in all "
                  f"({macs} an instruction at 16-bit activations)")
            figures.append(Figure(name, "tokenmill", name, "G multiply-adds/s",
                                  [per_thread * args.threads * macs / 1e9], True,
                                  {"threads": args.threads, "per_instruction": macs}))
    if not args.no_result:
        results.write(results.build("int-peak", "Integer multiply-add ceiling", figures))


if __name__ == "__main__":
    main()
