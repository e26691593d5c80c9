"""Where a batched fused decode step's time goes: its LM head against its layers.

Issue 58 (Gemma 3 at W2's concurrency 16): a served decode step of 16 rows is one
native call (tm_decode_batch), so a profiler sees one function. This runs the engine on
--model (default: the gemma3-270m file) in-process, fills the KV cache with --rows
W2 prompts of 128 tokens and a few decoded tokens, captures one real --rows-row step
and replays it: with its LM head, and without it (logits NULL: the kernel skips the
head; every other write is the same, so a replay is idempotent), alternating, --steps
times each. Wall and CPU seconds per step, per --quantization mode, each mode in its
own process started with OMP_WAIT_POLICY=passive (threads waiting at a barrier sleep
instead of spinning), so that CPU seconds count work and not waits: on a busy host read
the CPU column (both threads' seconds, summed), on a quiet one the wall column too.

The floor printed beside them is the step's vpdpbusd count (gguf-a16 runs two
activation planes, so two per multiply-add group of 64; gguf-a8 one) at one 512-bit
vpdpbusd a cycle a core (Zen 4 issues one; the clock from /proc/cpuinfo): the integer
multiply-adds alone, before scales, unpacking, attention and norms.

    python -m benchmarks run decode-split                        # gemma3-270m, 16 rows
    python -m benchmarks run decode-split --rows 8 --modes gguf-a16 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.workloads.w2_serving import W2_PROMPTS


def _cpu_ghz() -> float | None:
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
    except OSError:
        return None
    return max(mhz) / 1000 if mhz else None


def vpdpbusd_per_step(cfg: dict, rows: int, bits: int) -> tuple[int, int]:
    """(layers, LM head) 512-bit vpdpbusd of one step of `rows` rows: 64 multiply-adds
    each, one pass per activation plane (16-bit activations: two)."""
    h, d, inter = cfg["hidden"], cfg["head_dim"], cfg["inter"]
    per_layer = (h * (cfg["heads"] + 2 * cfg["kv_heads"]) * d + cfg["heads"] * d * h
                 + h * 2 * inter + inter * h)
    planes = 2 if bits == 16 else 1
    return (cfg["layers"] * per_layer * rows * planes // 64,
            cfg["vocab"] * h * rows * planes // 64)


def _prompts(path: str, n: int) -> list[str]:
    with open(path) as f:
        data = json.load(f)
    texts = [p if isinstance(p, str) else p.get("prompt", "") for p in data]
    return texts[:n]


def measure(model: str, mode: str, rows: int, steps: int, prompts_path: str) -> dict:
    """One mode's figures, in this process (started by `main` with a passive wait policy)."""
    import torch

    from tokenmill import LLM, SamplingParams
    from tokenmill.kernels import decode_step as native

    llm = LLM(model, quantization=mode)
    captured: list[tuple] = []
    original = native.step_batch

    def capture(*args, **kwargs):
        if args[1].shape[0] == rows and not captured:
            call = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            captured.append((*call, *([kwargs.get("shared_blocks", 0)] * (9 - len(call)))))
        return original(*args, **kwargs)

    native.step_batch = capture
    try:
        llm.generate(_prompts(prompts_path, rows),
                     SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                     use_tqdm=False)
    finally:
        native.step_batch = original
    if not captured:
        raise SystemExit(f"no fused decode step of {rows} rows ran with --quantization {mode} "
                         "(the module path serves it: see the engine's debug log)")
    record, ids, pos, slots, tables, lens, hidden, logits, shared = captured[0]
    times: dict[str, list[tuple[float, float]]] = {"step": [], "no LM head": []}
    for _ in range(steps):
        for name, out in (("step", logits), ("no LM head", None)):
            w0, c0 = time.perf_counter(), time.process_time()
            rc = original(record, ids, pos, slots, tables, lens, hidden, out, shared)
            times[name].append((time.perf_counter() - w0, time.process_time() - c0))
            if rc:
                raise SystemExit(f"tm_decode_batch returned {rc}")
    r = record
    cfg = {"layers": r.num_layers, "hidden": r.hidden, "heads": r.heads,
           "kv_heads": r.kv_heads, "head_dim": r.head_dim, "inter": r.inter,
           "vocab": r.vocab, "bits": r.bits}
    return {"mode": mode, "config": cfg, "threads": torch.get_num_threads(),
            "wall": {k: statistics.median(w for w, _ in v) for k, v in times.items()},
            "cpu": {k: statistics.median(c for _, c in v) for k, v in times.items()}}


def report(res: dict, rows: int, ghz: float | None) -> None:
    wall, cpu, cfg = res["wall"], res["cpu"], res["config"]
    head_w, head_c = wall["step"] - wall["no LM head"], cpu["step"] - cpu["no LM head"]
    layers_i, head_i = vpdpbusd_per_step(cfg, rows, cfg["bits"] or 16)
    print(f"{res['mode']} ({cfg['bits']}-bit activations), {rows} rows, "
          f"{res['threads']} threads:")
    print(f"  {'part':<10} {'wall ms':>8} {'cpu ms':>8} {'cpu share':>9} "
          f"{'vpdpbusd':>10} {'floor ms':>8}")
    for name, w, c, n in (("layers", wall["no LM head"], cpu["no LM head"], layers_i),
                          ("LM head", head_w, head_c, head_i),
                          ("step", wall["step"], cpu["step"], layers_i + head_i)):
        floor = f"{n / (ghz * 1e6 * res['threads']):8.2f}" if ghz else "       -"
        print(f"  {name:<10} {1e3 * w:8.2f} {1e3 * c:8.2f} {c / cpu['step']:9.0%} "
              f"{n / 1e6:9.1f}M {floor}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20, help="replays of each variant")
    ap.add_argument("--modes", default="gguf-a16,gguf-a8",
                    help="comma-separated --quantization modes, each in its own process")
    ap.add_argument("--prompts", default=str(W2_PROMPTS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child: one mode, JSON out
    args = ap.parse_args(argv)
    if args.rows < 2:
        raise SystemExit("--rows: at least 2 (one row runs tm_decode_step, not the batch)")
    if args.one:
        print("RESULT " + json.dumps(measure(args.model, args.one, args.rows, args.steps,
                                             args.prompts)), flush=True)
        return
    ghz = _cpu_ghz()
    print(f"decode-split: {args.model}, {args.rows} rows, {args.steps} replays each; "
          f"clock {ghz or '?'} GHz (/proc/cpuinfo)")
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    for mode in args.modes.split(","):
        cmd = [sys.executable, "-m", "benchmarks", "run", "decode-split", "--model",
               args.model, "--rows", str(args.rows), "--steps", str(args.steps),
               "--prompts", args.prompts, "--one", mode]
        out = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
        line = next((s for s in out.stdout.splitlines() if s.startswith("RESULT ")), None)
        if out.returncode or line is None:
            print(f"{mode}: failed ({out.returncode}):\n{(out.stdout + out.stderr)[-2000:]}")
            continue
        report(json.loads(line[len("RESULT "):]), args.rows, ghz)


if __name__ == "__main__":
    main()
