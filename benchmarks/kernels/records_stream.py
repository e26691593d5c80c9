"""A batch-1 decode step's kernel records streamed by the per-row kernel, without the
engine: how close q4q8_gemv.c gets to what the memory gives two threads, and what
transparent huge pages, the activations' bits and the software prefetch change.

records_stream.c (beside this file) lays out random records of a model's linears at
their real sizes and formats (the ~1B Q4_K_M file's: 648.5 MiB, Q4K records and Q6 ones for
every other layer's v and down and the LM head; or SmolLM2's) in one private mapping,
advised MADV_HUGEPAGE or MADV_NOHUGEPAGE (4 KiB pages), and runs a step as decode_step.c
does (one OpenMP region, each op's row groups in runs, a barrier per op). Beside each
step the same threads read the same bytes with plain loads: the floor. One row a
configuration: the step's median time, the records' GB/s, the read's, their ratio and
the records' AnonHugePages (0 with huge pages on means the system gave none). Timings:
run it on a quiet machine, a few seconds a configuration.

The ~1B file's Q4_K tensors run as FMT_Q4K records (Q4_K's own super-blocks, 4.5 bits
a weight, what tokenmill loads since issue 56's second round) and, beside them, as the
per-32 Q4 records of before (5.0 bits): `--q4-records q4k,q4` (the default) is that A/B
in one build, row by row.

    python -m benchmarks run records-stream [--model llama-1b] [--threads 2]
        [--q4-records q4k,q4]
        [--prefetch 6:t0,12:t0,24:t1,48:t1]   # records ahead : cache of _mm_prefetch
        [--kernels OTHER_CHECKOUT/tokenmill/kernels]   # another revision's kernel
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenmill.kernels import build

SOURCE = Path(__file__).with_name("records_stream.c")
KERNELS = Path(build.__file__).parent
HINTS = {"t0": 3, "t1": 2, "t2": 1, "nta": 0}  # gcc's _MM_HINT_* values
DEFAULT_PREFETCH = "6:t0"  # q4q8_gemv.c's PF_RECORDS and PF_HINT


def compile_variant(compiler: str, workdir: Path, records: int, hint: str,
                    march: str, kernels: Path) -> Path:
    exe = workdir / f"records_stream_{records}_{hint}_{march.replace('-', '_')}"
    subprocess.run([compiler, "-O3", f"-march={march}", "-ffast-math", "-fopenmp",
                    f"-I{kernels}", f"-DPF_RECORDS={records}", f"-DPF_HINT={HINTS[hint]}",
                    str(SOURCE), "-o", str(exe), "-lm"], check=True)
    return exe


def run(exe: Path, model: str, huge: bool, bits: int, threads: int, steps: int,
        q4k: bool = False) -> dict:
    out = subprocess.run([str(exe), model, str(int(huge)), str(bits), str(threads), str(steps),
                          str(int(q4k))], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b", choices=("llama-1b", "smollm2"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="timed steps a configuration")
    ap.add_argument("--bits", default="16,8", help="activation bits (gguf-a16, gguf-a8)")
    ap.add_argument("--prefetch", default=DEFAULT_PREFETCH,
                    help="records ahead:cache (t0, t1, t2, nta) per variant, comma separated")
    ap.add_argument("--march", default="native",
                    help="gcc -march (x86-64-v3: the AVX2 build on an AVX-512 machine)")
    ap.add_argument("--kernels", type=Path, default=KERNELS,
                    help="the q4q8_gemv.c to build against (another checkout's "
                    "tokenmill/kernels: an A/B of a kernel change)")
    ap.add_argument("--q4-records", default="q4k,q4",
                    help="the ~1B file's Q4_K tensors as q4k (their own super-blocks) and/or "
                    "q4 (per-32 records, fp16 scales: before); smollm2 has no Q4_K")
    args = ap.parse_args(argv)
    q4_forms = args.q4_records.split(",")
    if any(f not in ("q4k", "q4") for f in q4_forms):
        sys.exit("--q4-records: q4k and/or q4")
    if args.model != "llama-1b":
        q4_forms = ["q4"]
    compiler = build.compiler()
    if compiler is None:
        sys.exit("records_stream.py: no C compiler ($CC, cc or gcc)")
    variants = []
    for item in args.prefetch.split(","):
        records, _, hint = item.partition(":")
        if hint not in HINTS or not records.isdigit():
            sys.exit(f"--prefetch: {item!r} is not RECORDS:HINT (hint one of {', '.join(HINTS)})")
        variants.append((int(records), hint))
    bits = [int(b) for b in args.bits.split(",")]
    if any(b not in (8, 16) for b in bits):
        sys.exit("--bits: 8 and/or 16")
    print(f"{'prefetch':>9} {'pages':>6} {'bits':>4} {'Q4_K':>4} {'MiB':>5} {'step ms':>8} "
          f"{'GB/s':>6} {'read GB/s':>9} {'of read':>7} {'huge MiB':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for records, hint in variants:
            exe = compile_variant(compiler, Path(tmp), records, hint, args.march,
                                  args.kernels)
            for huge, b, form in ((h, b, f) for h in (True, False) for b in bits
                                  for f in q4_forms):
                r = run(exe, args.model, huge, b, args.threads, args.steps, form == "q4k")
                print(f"{records:>5}:{hint:<3} {'2 MiB' if huge else '4 KiB':>6} {b:>4} "
                      f"{form:>4} {r['record_mib']:>5.0f} "
                      f"{r['step_ms']:>8.2f} {r['kernel_gb_s']:>6.1f} "
                      f"{r['read_gb_s']:>9.1f} {r['kernel_vs_read']:>7.2f} "
                      f"{r['anon_huge_mib']:>8.0f}", flush=True)
    print(f"{args.model}: MiB = records a step, {args.threads} threads, "
          f"ISA {('plain C', 'AVX2', 'AVX-512 VNNI')[r['isa']]}")
