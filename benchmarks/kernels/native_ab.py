"""A/B of a native kernel against its build at another git revision, in one process.

This VM's speed drifts by 10-30% between runs minutes apart, so a kernel change is
measured by alternating the two builds round by round (or step by step) in one process,
not by two runs. The other revision's `tokenmill/kernels/*.c` and `*.h` are read with
`git show`, built by tokenmill/kernels/build.py into the kernel cache, and swapped in
for `build.load` of one library name.

    # decode attention alone (SmolLM2's heads, 30 layers' pools, from DRAM)
    python -m benchmarks run native-ab kernel --rev HEAD~1 --rows 16 --context 512
    # the same over 8-bit pools (tm_paged_decode_q8), or whole steps with that cache
    python -m benchmarks run native-ab kernel --rev HEAD~1 --rows 64 --context 350 \
        --kv-cache-dtype int8
    # the shared-prefix (cascade) path: --shared tokens read once for the batch
    python -m benchmarks run native-ab kernel --rev HEAD~1 --rows 16 --context 80 \\
        --shared 1024
    # whole engine decode steps (the fused step, decode_step.c), alternating step by step
    python -m benchmarks run native-ab step --rev HEAD~1 --rows 16 --context 128
    # the same with every request under a LoRA adapter (rank 16 on all 7 projections,
    # lora-overhead's); --rows 1: the batch-1 step (tm_decode_step)
    python -m benchmarks run native-ab step --rev HEAD~1 --rows 1 --context 128 \
        --lora-rank 16
    # one decode step's linears on q4q8_gemv.c (benchmarks run q4q8-step's records)
    python -m benchmarks run native-ab linears --rev HEAD~1 --rows 16 [--bits 8 | --gemm16]

Prints each build's median and minimum, old / new, and (kernel and linears modes)
whether the two builds gave the same bits.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository
KERNELS = ROOT / "tokenmill" / "kernels"


def build_at(rev: str, name: str) -> ctypes.CDLL:
    """Library `name` built from the kernel sources at git revision `rev`."""
    from tokenmill.kernels import build

    src = Path(tempfile.mkdtemp(prefix="tokenmill-ab-"))
    listed = subprocess.run(["git", "ls-tree", "--name-only", rev, "tokenmill/kernels/"],
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    for path in listed.split():
        if path.endswith((".c", ".h")):
            text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout
            (src / Path(path).name).write_text(text)
    compiler = build.compiler()  # the new build's compiler (build.load's)
    if compiler is None:
        sys.exit("native_ab.py: no C compiler ($CC, cc or gcc)")
    for flags in build.flag_sets():
        so = build._build(compiler, src / f"{name}.c", flags)
        if so is not None:
            return ctypes.CDLL(str(so))
    sys.exit(f"{name}.c at {rev} did not build")


def swap(name: str, lib: ctypes.CDLL) -> None:
    """`build.load(name)` returns `lib` from now on (Library.get rebinds on a new lib)."""
    from tokenmill.kernels import build

    original = getattr(build, "_ab_original_load", build.load)
    build._ab_original_load = original
    build.load = lambda n: lib if n == name else original(n)


def alternate(name: str, old: ctypes.CDLL, new: ctypes.CDLL, one_pass: Callable[[], Any],
              rounds: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """one_pass timed with library `name` swapped to each build in turn, `rounds` times
    (a warm pass before each timed one): each build's times, and its last output."""
    times: dict[str, list[float]] = {"old": [], "new": []}
    outs: dict[str, Any] = {}
    for _ in range(rounds):
        for label, lib in (("old", old), ("new", new)):
            swap(name, lib)
            outs[label] = one_pass()
            t0 = time.perf_counter()
            one_pass()
            times[label].append(time.perf_counter() - t0)
    return times, outs


Pair = tuple[torch.Tensor, torch.Tensor]


def quantized_pools(k: torch.Tensor, v: torch.Tensor, fmt: Any) -> tuple[Pair, Pair]:
    """bf16 pools (kv_heads, blocks, block_size, dim) stored into 8-bit ones of `fmt`, as
    the engine stores them: ((K bytes, V bytes), (K scales, V scales))."""
    from tokenmill.attention import kv_quant

    heads, blocks, bs, dim = k.shape
    k8, v8 = (torch.empty(k.shape, dtype=fmt.dtype) for _ in range(2))
    ks, vs = (torch.zeros(heads, blocks, bs) for _ in range(2))
    rows = [t.permute(1, 2, 0, 3).reshape(blocks * bs, heads, dim).contiguous() for t in (k, v)]
    kv_quant.store(*rows, k8, v8, ks, vs, torch.arange(blocks * bs), fmt)
    return (k8, v8), (ks, vs)


def kernel_mode(args: argparse.Namespace, old: ctypes.CDLL, new: ctypes.CDLL) -> None:
    from tokenmill.attention.kv_quant import kv_format
    from tokenmill.kernels import paged_decode

    heads, kv_heads, dim, bs = 9, 3, 64, 16
    rng = random.Random(0)
    shared = args.shared // bs
    own = -(-args.context // bs)
    num_blocks = shared + args.rows * own + 8
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables = torch.tensor([order[:shared] + order[shared + b * own:shared + (b + 1) * own]
                           for b in range(args.rows)], dtype=torch.int32)
    lens = torch.full((args.rows,), args.context, dtype=torch.int32)
    pools = [(torch.randn(kv_heads, num_blocks, bs, dim).to(torch.bfloat16),
              torch.randn(kv_heads, num_blocks, bs, dim).to(torch.bfloat16))
             for _ in range(args.layers)]
    fmt = kv_format(args.kv_cache_dtype)
    if fmt is not None:
        if shared:
            sys.exit("--shared: the cascade reads bf16 pools only")
        pools = [quantized_pools(k, v, fmt) for k, v in pools]
    q = torch.randn(args.rows, heads, dim).to(torch.bfloat16)
    scratch = torch.empty(args.rows * heads * args.context * 2, dtype=torch.float32)

    def workspace(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.float32)

    def one_pass() -> torch.Tensor:
        for k, v in pools:
            if shared:
                out = paged_decode.cascade_decode(q, k, v, tables, shared, lens, args.context,
                                                  dim ** -0.5, workspace)
            elif fmt is not None:  # k: both pools' bytes, v: their scales
                out = paged_decode.paged_decode_q8(q, *k, *v, tables, 0, lens, args.context,
                                                   dim ** -0.5, scratch)[0]
            else:
                out = paged_decode.paged_decode(q, k, v, tables, 0, lens, args.context,
                                                dim ** -0.5, scratch)[0]
            if out is None:
                sys.exit("the kernel did not take these inputs")
        return out

    times, outs = alternate("paged_decode", old, new, one_pass, args.rounds)
    what = (f"{args.rows} rows x ({args.shared} shared + {args.context}) tokens" if shared
            else f"{args.rows} rows x {args.context} tokens")
    report(f"decode attention, {what}, {args.layers} layers", times)
    print(f"same bits: {torch.equal(outs['old'], outs['new'])}")


def step_mode(args: argparse.Namespace, old: ctypes.CDLL, new: ctypes.CDLL) -> None:
    from tokenmill.cli.engine_args import add_engine_args, engine_config_from_args
    from tokenmill.engine.core.llm_engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams

    swap("decode_step", new)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = ([] if args.shared else ["--no-prefix-caching"]) + [
        "--kv-cache-dtype", args.kv_cache_dtype]
    lora = None
    if args.lora_rank:
        from benchmarks.features.lora_overhead import write_adapter
        from tokenmill.lora_request import LoRARequest

        path = Path(tempfile.mkdtemp(prefix="tokenmill-ab-lora-")) / "a0"
        write_adapter(path, args.lora_rank, seed=0)
        flags += ["--enable-lora", "--max-loras", "1", "--max-lora-rank",
                  str(args.lora_rank)]
        lora = LoRARequest("a0", 1, str(path))
    engine = LLMEngine(engine_config_from_args(parser.parse_args(["smollm2-135m", *flags])))
    rng = random.Random(0)
    prefix = [rng.randrange(100, 49000) for _ in range(args.shared)]
    times: dict[str, list[float]] = {"old": [], "new": []}
    for rnd in range(2):
        for i in range(args.rows):
            ids = prefix + [rng.randrange(100, 49000) for _ in range(args.context)]
            engine.add_request(f"{rnd}-{i}", ids, SamplingParams(
                temperature=0, max_tokens=args.new_tokens, ignore_eos=True), lora_request=lora)
        k = 0
        while engine.has_unfinished_requests():
            label = "old" if k % 2 else "new"
            swap("decode_step", old if label == "old" else new)
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            if len(outs) == args.rows and all(len(o.outputs[0].token_ids) > 1 for o in outs):
                times[label].append(dt)  # a decode step of every row
            k += 1
    adapter = f", under a rank-{args.lora_rank} adapter" if args.lora_rank else ""
    report(f"engine decode steps of {args.rows} rows, {args.shared} + {args.context}-token "
           f"prompts{adapter}", times)


def linears_mode(args: argparse.Namespace, old: ctypes.CDLL, new: ctypes.CDLL) -> None:
    from benchmarks.kernels.q4q8_step import LM_HEAD, SHAPES, records
    from tokenmill.kernels import q4q8_gemv
    from tokenmill.quant import huge_pages

    gen = torch.Generator().manual_seed(0)
    head = LM_HEAD
    if args.head:  # HIDDENxVOCAB: another model's Q8_0 LM head (gemma3-270m: 640x262144)
        hidden, vocab = (int(v) for v in args.head.split("x"))
        head = (hidden, vocab, LM_HEAD[2])
    step = SHAPES * args.layers + [head]
    weights = [records(k, n, f, gen) for k, n, f in step]
    weights = huge_pages.gather(weights) or weights
    xs = [torch.randn((args.rows, k), generator=gen).bfloat16() for k, _, _ in step]

    kernel = (q4q8_gemv.gemm16 if args.gemm16
              else functools.partial(q4q8_gemv.linear, bits=args.bits))

    def one_pass() -> list[torch.Tensor]:
        return [kernel(x, w, n, f) for (_, n, f), w, x in zip(step, weights, xs, strict=True)]

    times, outs = alternate("q4q8_gemv", old, new, one_pass, args.rounds)
    which = "gemm16" if args.gemm16 else f"{args.bits}-bit activations"
    report(f"one decode step's linears ({args.layers} layers + LM head), {args.rows} rows, "
           f"{which}", times)
    same = all(torch.equal(a, b) for a, b in zip(outs["old"], outs["new"], strict=True))
    print(f"same bits: {same}")


def report(what: str, times: dict[str, list[float]]) -> None:
    parts = [f"{label} median {statistics.median(t) * 1e3:.2f} ms, min {min(t) * 1e3:.2f}"
             f" ({len(t)})" for label, t in times.items()]
    ratio = statistics.median(times["old"]) / statistics.median(times["new"])
    print(f"{what}: " + "; ".join(parts) + f"; old / new {ratio:.3f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["kernel", "step", "linears"])
    ap.add_argument("--rev", required=True, help="the other build's git revision (old)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=512,
                    help="each row's own tokens (step mode: its prompt)")
    ap.add_argument("--shared", type=int, default=0,
                    help="tokens of a prefix every row shares (a multiple of 16)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--kv-cache-dtype", default="auto",
                    choices=("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"),
                    help="kernel and step modes: the KV pools' format")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="step mode: every request under a LoRA adapter of this rank on all "
                    "7 projections (0: none)")
    ap.add_argument("--bits", type=int, default=16, choices=(8, 16), help="linears mode")
    ap.add_argument("--head", help="linears mode: the LM head's HIDDENxVOCAB (default "
                    "SmolLM2's; with --layers 0 the head alone)")
    ap.add_argument("--gemm16", action="store_true",
                    help="linears mode: tm_q4q8_gemm16 (AVX2's batched kernel, 16-bit)")
    args = ap.parse_args(argv)
    name = {"kernel": "paged_decode", "step": "decode_step", "linears": "q4q8_gemv"}[args.mode]
    from tokenmill.kernels import build

    new = build.load(name)
    if new is None:
        sys.exit(f"{name} is not built here")
    old = build_at(args.rev, name)
    {"kernel": kernel_mode, "step": step_mode, "linears": linears_mode}[args.mode](
        args, old, new)


if __name__ == "__main__":
    main()
