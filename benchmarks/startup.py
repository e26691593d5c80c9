"""`tokenmill serve` start-up: from the exec of the command to the first
/health 200, best of N, with the phase times the server logs at
--log-level debug (tokenmill/startup_timer.py) for the best run. Run it on a
quiet machine with the kernel cache warm (one run before the timed ones warms it).

    .venv/bin/python benchmarks/startup.py --runs 3
    .venv/bin/python benchmarks/startup.py --runs 3 -- --engine-in-process
    .venv/bin/python -m benchmarks.startup --runs 3 --record   # + a result in benchmarks/results
    .venv/bin/python -m benchmarks.startup --model gemma3-270m --runs 3 --record
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(model: str, extra: list[str]) -> tuple[float, list[str]]:
    """Seconds from the exec to the first /health 200, and the start-up log lines."""
    port = _free_port()
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", model,
                                 "--port", str(port), "--log-level", "debug", *extra],
                                stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"the server exited with {proc.returncode}:\n"
                                     f"{log.read()[-3000:]}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code \
                            == 200:
                        ready_s = time.perf_counter() - t0
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.01)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        log.seek(0)
        phases = [("[core] " if "[core]" in line else "       ")
                  + line.split("start-up: ", 1)[1].rstrip() for line in log
                  if "start-up: " in line]
    return ready_s, phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--record", action="store_true",
                    help="write a schema-1 result (run as python -m benchmarks.startup)")
    ap.add_argument("extra", nargs="*", help="more `tokenmill serve` flags (after --)")
    args = ap.parse_args()
    one_run(args.model, args.extra)  # warms the kernel and tokenizer caches
    results = [one_run(args.model, args.extra) for _ in range(args.runs)]
    for i, (ready_s, _) in enumerate(results):
        print(f"run {i + 1}: /health 200 after {ready_s:.3f} s")
    best_s, phases = min(results)
    print(f"best of {args.runs}: {best_s:.3f} s (target <= 4 s)\nphases of the best run "
          "(each process's own clock from its exec; the core starts at 'engine core "
          "spawned'):")
    for phase in phases:
        print("  " + phase)
    if args.record:
        _record(args, [r[0] for r in results], phases)


def _record(args: argparse.Namespace, ready_s: list[float], phases: list[str]) -> None:
    """One figure for the time to /health 200 (every run), one per phase of the best run."""
    from benchmarks import results

    config = {"model": args.model, "flags": " ".join(args.extra)}
    figures = [results.Figure("tokenmill serve -> /health 200", "tokenmill", "start-up", "s",
                              ready_s, False, config)]
    for line in phases:  # "[core] weights read   done at  2.1 s (0.9 s; cpu 0.8 s)"
        name, _, rest = line.partition(" done at ")
        name = " ".join(name.split())
        took = float(rest.rsplit("(", 1)[1].split()[0])
        figures.append(results.Figure(f"phase: {name}", "tokenmill", "start-up phase", "s",
                                      [took], False, config))
        if "; cpu " in rest:  # the process's CPU seconds on the phase (all its threads)
            cpu_s = float(rest.rsplit("; cpu ", 1)[1].split()[0])
            figures.append(results.Figure(f"phase cpu: {name}", "tokenmill",
                                          "start-up phase cpu", "s", [cpu_s], False, config))
    results.write(results.build(
        "startup", "Start-up: `tokenmill serve` to the first /health 200", figures,
        variant=None if args.model == "smollm2-135m" else args.model,
        notes=[(f"best of {len(ready_s)} after one warming run (kernel and tokenizer caches "
               "warm); phases are the best run's, each process on its own clock, the core "
               "in parallel with the front end (docs/startup.md); target <= 4 s")]))


if __name__ == "__main__":
    main()
