"""What the C heap does between trims (issue 64): the in-process engine, malloc_trim off.

Waves of requests with mixed prompt (16-384 tokens) and output (4-16) lengths, random
token ids (seed 0); after each wave: RSS, glibc's mallinfo2 (the arenas' size, in use,
free, and the separately mapped blocks) and the number of Python objects. The KV pool
is prefaulted, so RSS does not climb as blocks are first touched. Compare variants by
environment, one process each:

    python -m benchmarks run heap-growth --requests 320
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 python -m benchmarks run heap-growth --requests 320
    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=262144 python -m benchmarks run heap-growth

Memory, not timing: it may run on a busy machine. Findings: docs/memory.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random

MIB = 1 << 20


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="heap-growth", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=320)
    ap.add_argument("--wave", type=int, default=8, help="requests per generate call")
    ap.add_argument("--trim-s", default="0",
                    help="TOKENMILL_MALLOC_TRIM_S for the engine (default 0: no trimming)")
    args = ap.parse_args(argv)
    os.environ["TOKENMILL_MALLOC_TRIM_S"] = args.trim_s

    from tokenmill import LLM, SamplingParams, malloc

    llm = LLM(model=args.model, max_model_len=2048, kv_cache_memory=256 * MIB,
              kv_cache_prefault=True)
    rng = random.Random(0)
    rows = []

    def sample(done: int) -> None:
        heap = malloc.heap_stats()
        row = {"requests": done, "rss_mib": _rss_mib(), "python_objects": len(gc.get_objects())}
        if heap is not None:
            row.update(arena_mib=heap.arena_bytes // MIB, in_use_mib=heap.in_use_bytes // MIB,
                       free_mib=heap.free_bytes // MIB, mmapped_mib=heap.mmapped_bytes // MIB)
        rows.append(row)
        print(json.dumps(row), flush=True)

    def wave(n: int) -> None:
        prompts = [[rng.randrange(100, 40_000) for _ in range(rng.randint(16, 384))]
                   for _ in range(n)]
        params = [SamplingParams(max_tokens=rng.randint(4, 16), ignore_eos=True,
                                 temperature=0) for _ in range(n)]
        llm.generate(prompts, params, use_tqdm=False)

    wave(1)
    sample(0)
    done = 0
    while done < args.requests:
        wave(args.wave)
        done += args.wave
        sample(done)
    if len(rows) > 2:
        a, b = rows[1], rows[-1]  # from the first wave on: what load and warm-up left aside
        span = b["requests"] - a["requests"]
        per = {k: (b[k] - a[k]) / span for k in a if k != "requests"}
        print("per request after the first wave: " + ", ".join(
            f"{k} {v:+.3f}" for k, v in per.items()))
    return 0
