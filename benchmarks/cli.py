"""The benchmarks' one entry point.

    python -m benchmarks list                                   # every benchmark, one line each
    python -m benchmarks run w3 --peers llama --model F.gguf    # one benchmark; its own --help
    python -m benchmarks run all --peers llama,vllm,transformers --repeats 3   # W1-W5
    python -m benchmarks report                                 # BENCHMARKS.md from results/

`run NAME ARGS...` hands ARGS to that benchmark's own parser (`run w3 --help` lists
them). `run all` runs W1-W5 in turn with the options given to it: --peers keeps, for
each workload, the peers it has (none left: --skip-peers); --model and --repeats go to
the workloads that take them, and one that does not is named, not ignored.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys

from benchmarks.registry import BENCHMARKS, WORKLOADS, find


def _list() -> int:
    for kind in ("workload", "feature", "kernel"):
        print(f"{kind}s:")
        for b in BENCHMARKS:
            if b.kind == kind:
                mark = "" if b.writes_result else "  (prints only)"
                print(f"  {b.name:<18} {b.summary}{mark}")
    print("run one: python -m benchmarks run NAME [--help]; all workloads: run all")
    return 0


def all_argv(name: str, peers: str | None, skip_peers: bool, model: str | None,
             repeats: int | None) -> tuple[list[str], list[str]]:
    """The arguments `run all` gives workload `name`, and the options it does not take
    (said aloud, never dropped silently)."""
    bench = find(name)
    argv: list[str] = []
    if skip_peers:
        argv.append("--skip-peers")
    elif peers is not None:
        own = importlib.import_module(bench.module).PEERS
        mine = [p for p in (x.strip() for x in peers.split(",")) if p in own]
        argv += ["--peers", ",".join(mine)] if mine else ["--skip-peers"]
    not_taken = []
    for flag, value in (("--model", model), ("--repeats", repeats)):
        if value is None:
            continue
        if flag in bench.shared:
            argv += [flag, str(value)]
        else:
            not_taken.append(flag)
    return argv, not_taken


def _run_all(rest: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks run all")
    ap.add_argument("--peers", default=None, help="comma-separated: vllm,llama,transformers")
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--model", default=None, help="GGUF file or alias, for W2-W4")
    ap.add_argument("--repeats", type=int, default=None, help="for W1-W5")
    args = ap.parse_args(rest)
    if args.peers is not None:
        known = {"vllm", "llama", "transformers"}
        if bad := [p for p in args.peers.split(",") if p.strip() and p.strip() not in known]:
            ap.error(f"--peers: {', '.join(bad)} is not a peer (vllm, llama, transformers)")
    for name in WORKLOADS:
        argv, not_taken = all_argv(name, args.peers, args.skip_peers, args.model,
                                   args.repeats)
        for flag in not_taken:
            print(f"[benchmarks] {name} takes no {flag}: it runs with its own default",
                  flush=True)
        print(f"\n=== python -m benchmarks run {name} {' '.join(argv)}", flush=True)
        sys.argv = [sys.argv[0], "run", name, *argv]  # the command its result records
        find(name).main()(argv)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m benchmarks {list | run NAME|all [ARGS...] | report [--check]}"
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "list":
        return _list()
    if cmd == "report":
        from benchmarks.report import main as report_main

        return report_main(rest)
    if cmd != "run":
        print(f"unknown command {cmd!r}\n{usage}", file=sys.stderr)
        return 2
    if not rest:
        print(f"run: which benchmark? ({', '.join(b.name for b in BENCHMARKS)}, all)",
              file=sys.stderr)
        return 2
    name, rest = rest[0], rest[1:]
    if name == "all":
        return _run_all(rest)
    try:
        bench = find(name)
    except KeyError:
        print(f"run: no benchmark named {name!r} (python -m benchmarks list)", file=sys.stderr)
        return 2
    entry = bench.main()
    if "argv" not in inspect.signature(entry).parameters:
        raise SystemExit(f"{bench.module}.main takes no argv")
    status = entry(rest)
    return status if isinstance(status, int) else 0
