"""The CPU's instruction ceiling: FLOP/s per compute dtype from a tight loop of the one
instruction each path multiplies with, all threads at once.

A floor must be a bound, not a benchmark: a kernel's own measured rate is beaten by a
better kernel (a served decode step once read 105% of such a "floor"). The ceiling is
issue rate × lanes × clock, measured rather than looked up: twelve independent chains of
the instruction (more than its latency needs), in inline assembly, on one thread, the
best of many ~1 ms repetitions (a repetition shorter than a scheduler slice runs whole even
on a busy shared machine, where a long one would measure the contention), times the
threads the engine runs (one core each).

  fp32   vfmadd231ps          zmm: 16 lanes × 2 FLOPs (ymm on AVX2: 8 × 2)
  bf16   vdpbf16ps zmm        32 bf16 pairs × 2 (AVX512-BF16; else fp32's FMA)
  int8   vpdpbusd zmm         64 byte products × 2 (AVX2: vpmaddubsw ymm, 32 × 2)
  int16  vpdpbusd zmm         32 multiply-adds × 2 at 16-bit activations (the VNNI kernel
                              multiplies by the activations' two byte planes); AVX2:
                              vpmaddwd ymm, 16 × 2
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

# name -> (needed CPU flags, register class, instruction, FLOPs an instruction)
INSTRUCTIONS = {
    "vfmadd231ps zmm": ({"avx512f"}, "v", "vfmadd231ps %1, %2, %0", 32),
    "vfmadd231ps ymm": ({"avx2", "fma"}, "x", "vfmadd231ps %1, %2, %0", 16),
    "vdpbf16ps zmm": ({"avx512_bf16"}, "v", "vdpbf16ps %1, %2, %0", 64),
    "vpdpbusd zmm": ({"avx512_vnni"}, "v", "vpdpbusd %1, %2, %0", 128),
    "vpmaddubsw ymm": ({"avx2"}, "x",
                       "vpmaddubsw %1, %2, %%ymm15\\n\\tvpaddw %%ymm15, %0, %0", 64),
    "vpmaddwd ymm": ({"avx2"}, "x", "vpmaddwd %1, %2, %%ymm15\\n\\tvpaddd %%ymm15, %0, %0", 32),
}

# dtype -> the instructions its path may use, best first, with the share of an
# instruction's FLOPs that count at that dtype (int16 on VNNI: half, two byte planes)
PATHS = {
    "fp32": (("vfmadd231ps zmm", 1.0), ("vfmadd231ps ymm", 1.0)),
    "bf16": (("vdpbf16ps zmm", 1.0), ("vfmadd231ps zmm", 1.0), ("vfmadd231ps ymm", 1.0)),
    "int8": (("vpdpbusd zmm", 1.0), ("vpmaddubsw ymm", 1.0)),
    "int16": (("vpdpbusd zmm", 0.5), ("vpmaddwd ymm", 1.0)),
}

SOURCE = r"""
#include <immintrin.h>
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
    VEC a0 = SET1(1), a1 = SET1(2), a2 = SET1(3), a3 = SET1(4), a4 = SET1(5),
        a5 = SET1(6), a6 = SET1(7), a7 = SET1(8), a8 = SET1(9), a9 = SET1(10),
        a10 = SET1(11), a11 = SET1(12), w = SET1(3), x = SET1(5);
    for (int rep = 0; rep < REPS; rep++) {
        double t0 = now();
        for (long i = 0; i < n; i++) {
#define S(v) __asm__ volatile(INSN : "+" REG(v) : REG(w), REG(x) CLOBBER);
            S(a0) S(a1) S(a2) S(a3) S(a4) S(a5) S(a6) S(a7) S(a8) S(a9) S(a10) S(a11)
        }
        double t = now() - t0;
        if (t < best) best = t;
    }
    volatile VEC sink;
    sink = a0, sink = a1, sink = a2, sink = a3, sink = a4, sink = a5;
    sink = a6, sink = a7, sink = a8, sink = a9, sink = a10, sink = a11;
    (void)sink;
    printf("%.9f\n", best);
    return 0;
}
"""


def _instructions_per_s(cc: str, workdir: Path, name: str, iterations: int,
                        reps: int) -> float:
    """One thread's best rate."""
    _, reg, insn, _ = INSTRUCTIONS[name]
    zmm = reg == "v"
    defs = {
        "ITERATIONS": str(iterations), "REPS": str(reps),
        "VEC": "__m512i" if zmm else "__m256i",
        # 1.0f and up: no denormal FMAs
        "SET1(v)": f"_mm{'512' if zmm else '256'}_set1_epi32(0x3f800000 + (v))",
        "INSN": f'"{insn}"', "REG(v)": f'"{reg}"(v)',
        "CLOBBER": ': "xmm15"' if "ymm15" in insn else "",
    }
    src = workdir / "ceiling.c"
    src.write_text("".join(f"#define {k} {v}\n" for k, v in defs.items()) + SOURCE)
    exe = workdir / "ceiling"
    subprocess.run([cc, "-O2", "-march=native", str(src), "-o", str(exe)],
                   check=True, capture_output=True, text=True, timeout=120)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=120)
    return 12 * iterations / float(out.stdout.strip())


def measure_instruction_ceilings(threads: int, iterations: int = 100_000, reps: int = 300
                                 ) -> dict[str, object]:
    """{"flops": {dtype: FLOP/s}, "instructions": {name: instructions/s, all threads},
    "basis": {dtype: the instruction}} for the instructions this CPU has; {"flops": {},
    "why": ...} where no compiler is found."""
    from tokenmill.cpuinfo import cpu_flags
    from tokenmill.kernels.build import compiler

    cc = compiler()
    if cc is None:
        return {"flops": {}, "why": "no C compiler"}
    flags = cpu_flags()
    rates: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="tokenmill-ceiling-") as tmp:
        for name, (need, *_rest) in INSTRUCTIONS.items():
            if not need <= flags:
                continue
            try:
                rates[name] = threads * _instructions_per_s(cc, Path(tmp), name, iterations,
                                                            reps)
            except (subprocess.SubprocessError, OSError, ValueError) as e:
                return {"flops": {}, "why": f"{name}: {e}"}
    return {"threads": threads, "instructions": rates, **ceilings_from_rates(rates)}


def ceilings_from_rates(rates: dict[str, float]) -> dict[str, dict[str, object]]:
    """FLOP/s per dtype from instructions/s: the first instruction of its path the CPU has."""
    flops, basis = {}, {}
    for dtype, path in PATHS.items():
        for name, share in path:
            if name in rates:
                flops[dtype] = rates[name] * INSTRUCTIONS[name][3] * share
                basis[dtype] = name
                break
    return {"flops": flops, "basis": basis}
