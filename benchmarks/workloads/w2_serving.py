"""W2 online serving (PERFORMANCE.md): tokenmill, vLLM CPU and llama-server under one client.

Starts each server in turn on 127.0.0.1 and runs the same client over each,
`tokenmill bench`: 64 streaming /v1/completions requests per concurrency level
(1, 4, 16, 32), each level on the next 64 prompts of
../shared/data/w2_prompts_128.json (exactly 128 tokens each, all different),
max_tokens 128 with ignore_eos. Servers, in the same run: `tokenmill serve
smollm2-135m` (defaults: the embedded GGUF, the engine's own fastest path);
vLLM's CPU backend on the bf16 checkpoint of the same GGUF with both cores
(`VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0`, its best
figure here) and with its default (one core reserved for its front end) —
set up by benchmarks/peers/setup_vllm_cpu.sh, 90-110 s start-up each; and
`llama-server -t 2 -np 16 -c 16384 --no-webui` on the GGUF itself (built by
benchmarks/peers/build_llama_cpp.sh). Prints TTFT p50/p99, TPOT mean and
output tok/s per level and server, the ratios, the targets at concurrency 16
(against llama-server: the file's class's, w2_targets.py, or none), and each
run against this CPU's floor (`tokenmill explain` on its result: the decode
step against its floor, with the prompts that join its steps, and the verdict). A peer that cannot be set up is skipped with the reason. With --model FILE,
tokenmill serve and llama-server both run FILE (vLLM, which has a checkpoint of the
embedded model only, is skipped with that reason). The result:
benchmarks/results/<date>-<machine class>-w2[-<model>].json.

    python -m benchmarks run w2
    python -m benchmarks run w2 --peers vllm --vllm-threads both
    python -m benchmarks run w2 --peers llama --model F.gguf  # serve F vs llama-server -np 16 on F
    python -m benchmarks run w2 --skip-peers        # tokenmill only
    python -m benchmarks run w2 -- --max-num-seqs 32  # extra serve flags
    python -m benchmarks run w2 --also-serve "--quantization gguf-a16"  # a 2nd tokenmill
    python -m benchmarks run w2 --peers llama --model F.gguf --repeats 3  # medians of 3

--repeats N runs the servers' sequence N times over (tokenmill, llama-server, tokenmill,
...), so that a VM's drift between minutes falls on every server alike; each server's
figures then hold N runs, the tables and the targets read their medians, and each
repeat's own ratios are printed beside them.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks import results as results_mod
from benchmarks.common import DEFAULT_MODEL, embedded_gguf, machine, model_gguf
from benchmarks.floors import explain, floor_lines
from benchmarks.peers import (
    add_peer_args,
    ensure_servers,
    selected_peers,
    skip,
    start_llama_server,
    start_vllm_server,
)
from benchmarks.results import Figure
from benchmarks.server import start_server
from benchmarks.workloads.w2_targets import (
    TARGETS,
    W2Target,
    recorded_embedded_ratio,
    target_for,
    target_line,
)
from tokenmill.bench.pareto import pareto_figure

HERE = Path(__file__).resolve().parent
W2_PROMPTS = HERE.parents[2] / "shared" / "data" / "w2_prompts_128.json"
PEERS = ("vllm", "llama")
TITLE = "W2 online serving"
# how long `tokenmill serve` may take to answer /health: the synthetic MoE file (1.2 GiB,
# 3,072 expert record sets repacked at load) missed the shared 180 s on a busy 2-core host
READY_S = 600.0


def run_bench(base_url: str, levels: list[int], num_requests: int, output_len: int,
              out_path: Path, tokenizer: str) -> dict:
    """The bench JSON: one result per level in `runs`, their Pareto front in `pareto`."""
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "--base-url", base_url,
           "--dataset", "jsonl", "--dataset-path", str(W2_PROMPTS),
           "--output-len", str(output_len), "--num-requests", str(num_requests),
           "--sweep", "concurrency=" + ",".join(map(str, levels)),
           "--tokenizer", tokenizer, "--output", str(out_path), "--no-progress"]
    print("$ tokenmill " + " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out_path.read_text())


def served_model(base_url: str) -> str:
    """The name the server lists first at /v1/models (each server names a file its way)."""
    r = httpx.get(f"{base_url}/v1/models", timeout=60)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def warm_up(base_url: str) -> None:
    """One request outside the measured prompts, so that each level's prompts stay fresh."""
    r = httpx.post(f"{base_url}/v1/completions", timeout=600, json={
        "model": served_model(base_url), "prompt": "Hello", "max_tokens": 8})
    r.raise_for_status()


def bench_server(name: str, server, args, levels: list[int]) -> dict:
    """The server's sweep over the levels, as `tokenmill bench` wrote it."""
    try:
        warm_up(server.base_url)
        slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        out_path = Path(tempfile.mkdtemp(prefix="w2-")) / f"{slug}.json"
        if args.output:
            out_path = Path(args.output).with_suffix(f".{slug}.json")
        swept = run_bench(server.base_url, levels, args.num_requests, args.output_len,
                          out_path, args.tokenizer)
    finally:
        server.stop()
    print(f"  {name}: bench JSON {out_path}", flush=True)
    return swept


def print_floors(runs: dict[str, list[dict]], levels: list[int],
                 model: str | None = None) -> None:
    """Every server's run at every level against this CPU's floor (tokenmill explain);
    `model`: the GGUF file the servers ran, when not the embedded model."""
    print("against the floor (tokenmill explain --hardware cpu on each run's result):")
    for name, results in runs.items():
        for c, result in zip(levels, results):
            try:
                lines = floor_lines(explain(result, model))
            except (subprocess.CalledProcessError, ValueError, KeyError) as e:
                lines = [f"explain failed: {e}"]
            print(f"  {name}, c={c}:")
            for line in lines:
                print(f"    {line}")


def print_table(results: dict[str, list[dict]], levels: list[int]) -> None:
    print(f"{'server':<24} {'conc':>4} | {'out tok/s':>9} | {'TTFT p50':>9} {'TTFT p99':>9} | "
          f"{'TPOT mean':>9} | failed")
    for c_i, c in enumerate(levels):
        for name, summaries in results.items():
            s = summaries[c_i]
            print(f"{name:<24} {c:>4} | {s['output_throughput_tok_s']:9.1f} | "
                  f"{s['ttft_ms']['p50']:7.0f}ms {s['ttft_ms']['p99']:7.0f}ms | "
                  f"{s['tpot_ms']['mean']:7.1f}ms | {s['num_failed']}")


def print_targets(results: dict[str, list[dict]], levels: list[int],
                  target: W2Target | None = TARGETS["embedded"], verdicts: bool = True
                  ) -> None:
    """Ratios at every level (> 1 = tokenmill better), targets at concurrency 16 (against
    llama-server: the file's row of w2_targets.TARGETS; no line where it has none);
    `verdicts` False: the ratios only (one repeat of several)."""
    ours = results["tokenmill"]
    for name, summaries in results.items():
        if name == "tokenmill":
            continue
        for c_i, c in enumerate(levels):
            o, t = ours[c_i], summaries[c_i]
            print(f"tokenmill vs {name} at c={c}: output tok/s "
                  f"{o['output_throughput_tok_s'] / t['output_throughput_tok_s']:.2f}x, "
                  f"TTFT p50 {t['ttft_ms']['p50'] / o['ttft_ms']['p50']:.2f}x, TPOT "
                  f"{t['tpot_ms']['mean'] / o['tpot_ms']['mean']:.2f}x")
    if 16 not in levels or not verdicts:
        return
    c_i = levels.index(16)
    o = ours[c_i]
    tok_s, ttft50 = o["output_throughput_tok_s"], o["ttft_ms"]["p50"]
    vllm = results.get("vLLM (both cores)")
    if vllm:
        v = vllm[c_i]
        ok = (tok_s >= 2 * v["output_throughput_tok_s"]
              and ttft50 <= v["ttft_ms"]["p50"] / 2)
        print(f"target at c=16: >= 2x vLLM CPU (both cores) output tok/s and TTFT p50 <= 1/2 "
              f"of its -> {tok_s / v['output_throughput_tok_s']:.2f}x, "
              f"{v['ttft_ms']['p50'] / ttft50:.2f}x: {'met' if ok else 'missed'}")
    llama = next((v for k, v in results.items() if k.startswith("llama-server")), None)
    if llama:
        ratio_ = tok_s / llama[c_i]["output_throughput_tok_s"]
        embedded = None
        if target is not None and target.ratio is None:  # relative to the embedded file's
            embedded = recorded_embedded_ratio(results_mod.fingerprint()["class"])
        line = target_line(target, ratio_, embedded)
        print(line or f"no W2 target for this file against llama-server ({ratio_:.2f}x)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="GGUF file (or alias) that tokenmill serve and llama-server both run "
                    "(vLLM has a checkpoint of the embedded model only)")
    ap.add_argument("--concurrency", default="1,4,16,32", help="comma-separated levels")
    ap.add_argument("--num-requests", type=int, default=64, help="requests per level")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output", default=None,
                    help="keep the bench JSONs as OUTPUT.<server>.json")
    ap.add_argument("--vllm-threads", default="both,default",
                    help="vLLM runs: 'both' cores and/or its 'default' (default: both,default)")
    ap.add_argument("--llama-np", type=int, default=16, help="llama-server -np (slots)")
    ap.add_argument("--llama-ctx", type=int, default=16384, help="llama-server -c")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every server's sweep this many times, the servers alternated; "
                    "figures keep each run, tables and targets read the medians")
    ap.add_argument("--no-result", action="store_true",
                    help="print only; write no benchmarks/results/ file")
    ap.add_argument("--also-serve", action="append", default=[], metavar="FLAGS",
                    help="also bench `tokenmill serve` with these flags in the same run, "
                    "named 'tokenmill FLAGS' (the A/B a default change needs, issue 57: "
                    "e.g. \"--quantization gguf-a16\"); repeatable")
    add_peer_args(ap, PEERS)
    ap.add_argument("serve_args", nargs="*", help="extra `tokenmill serve` flags (after --)")
    args = ap.parse_args(argv)
    peers = selected_peers(args, PEERS)
    levels = [int(x) for x in args.concurrency.split(",")]
    vllm_threads = [t.strip() for t in args.vllm_threads.split(",") if t.strip()]
    if bad := [t for t in vllm_threads if t not in ("both", "default")]:
        raise SystemExit(f"--vllm-threads: {', '.join(bad)} is not 'both' or 'default'")
    gguf = model_gguf(args.model)
    args.tokenizer = str(gguf)
    default_model = args.model == DEFAULT_MODEL
    notes: list[str] = []
    if not default_model and "vllm" in peers:
        peers.discard("vllm")
        notes.append(f"vLLM skipped: its checkpoint (setup_vllm_cpu.sh) is the embedded "
                     f"model's, not {gguf.name}'s")
        print(f"[peers] {notes[-1]}")
    print(f"W2 online serving · {gguf.name} · {machine()}")
    if args.repeats < 1:
        raise SystemExit("--repeats: at least 1")
    vllm, llama = ensure_servers(peers)
    repeats: list[dict[str, dict]] = []  # each repeat's sweeps, by server
    for r in range(args.repeats):
        if args.repeats > 1:
            print(f"repeat {r + 1} of {args.repeats}", flush=True)
        repeats.append(sweep_servers(args, levels, gguf, vllm, llama, vllm_threads))
    sweeps = repeats[0]
    runs = {name: swept["runs"] for name, swept in repeats[-1].items()}
    per_repeat = [{name: [run["summary"] for run in swept["runs"]]
                   for name, swept in rep.items()} for rep in repeats]
    results = median_summaries(per_repeat, levels)
    print("same client (tokenmill bench) and prompts for every server; ratio > 1 = "
          "tokenmill better")
    if len(per_repeat) > 1:
        for r, rep in enumerate(per_repeat):
            print(f"repeat {r + 1}:")
            print_table(rep, levels)
            print_targets(rep, levels, verdicts=False)
        print(f"medians of the {len(per_repeat)} repeats (each column on its own):")
    print_table(results, levels)
    print_targets(results, levels, target_for(gguf, embedded_gguf()))
    print_floors(runs, levels, None if default_model else str(gguf))
    if not args.no_result:
        cfg = {"model": gguf.name, "requests": args.num_requests,
               "output_len": args.output_len}
        # extra serve flags (`-- --quantization gguf-a8`) name the result, beside the
        # default's rather than in its place
        extra = " ".join(args.serve_args)
        if extra:
            cfg["serve_args"] = extra
        if args.repeats > 1:
            cfg["repeats"] = args.repeats
        figures = figures_of(per_repeat, levels, cfg)
        result = results_mod.build(
            "w2", TITLE, figures, notes=notes,
            variant=result_variant(None if default_model else gguf.stem, args.serve_args))
        if len(levels) > 1:  # the servers' Pareto fronts over the levels, on one plot
            plot = results_mod.write_plot(result, "pareto", lambda plt: pareto_figure(
                plt, list(sweeps.values()), list(sweeps)))
            result["notes"].append(f"Pareto fronts of every server over the levels: {plot}")
        results_mod.write(result)


def sweep_servers(args, levels: list[int], gguf: Path, vllm, llama,
                  vllm_threads: list[str]) -> dict[str, dict]:
    """One sweep of every server in turn (tokenmill, its --also-serve variants, vLLM,
    llama-server), each started, warmed up, swept and stopped."""
    sweeps: dict[str, dict] = {}
    sweeps["tokenmill"] = bench_server(
        "tokenmill", start_server(args.model, *args.serve_args, ready_timeout_s=READY_S),
        args, levels)
    for flags in args.also_serve:
        name = f"tokenmill {flags}"
        sweeps[name] = bench_server(name, start_server(
            args.model, *args.serve_args, *shlex.split(flags), ready_timeout_s=READY_S),
            args, levels)
    for threads in vllm_threads if vllm is not None else []:
        name = "vLLM (both cores)" if threads == "both" else "vLLM (default)"
        try:
            server = start_vllm_server(vllm, threads=threads)
        except RuntimeError as e:
            skip(name, e)
            continue
        sweeps[name] = bench_server(name, server, args, levels)
    if llama is not None:
        name = f"llama-server -np {args.llama_np}"
        server = start_llama_server(llama, gguf, np=args.llama_np, ctx=args.llama_ctx)
        sweeps[name] = bench_server(name, server, args, levels)
    return sweeps


def _by_server(per_repeat: list[dict[str, list[dict]]]) -> dict[str, list[list[dict]]]:
    """Each server's per-level summaries from every repeat that has it, servers in the
    order they first ran."""
    names = dict.fromkeys(name for rep in per_repeat for name in rep)
    return {name: [rep[name] for rep in per_repeat if name in rep] for name in names}


def median_summaries(per_repeat: list[dict[str, list[dict]]], levels: list[int]
                     ) -> dict[str, list[dict]]:
    """Each server's summary at each level with the repeats' medians of the figures the
    tables and targets read (output tok/s, TTFT p50 and p99, TPOT mean) and their failed
    requests summed; one repeat: its summaries as they are. A server some repeat lacks
    (a peer that failed to start once) keeps the repeats it has."""
    if len(per_repeat) == 1:
        return per_repeat[0]
    out: dict[str, list[dict]] = {}
    for name, reps in _by_server(per_repeat).items():
        out[name] = []
        for c_i in range(len(levels)):
            level = [summaries[c_i] for summaries in reps]
            out[name].append({
                "output_throughput_tok_s": statistics.median(
                    s["output_throughput_tok_s"] for s in level),
                "ttft_ms": {q: statistics.median(s["ttft_ms"][q] for s in level)
                            for q in ("p50", "p99")},
                "tpot_ms": {"mean": statistics.median(s["tpot_ms"]["mean"] for s in level)},
                "num_failed": sum(s["num_failed"] for s in level)})
    return out


def result_variant(model_stem: str | None, serve_args: list[str]) -> str | None:
    """The result's variant: the model's file name (not the default model) and the extra
    serve flags, so that a run with `-- --quantization gguf-a8` lands beside the
    default's result rather than in its place."""
    return " ".join([*([model_stem] if model_stem else []), *serve_args]) or None


def figures_of(per_repeat: list[dict[str, list[dict]]] | dict[str, list[dict]],
               levels: list[int], cfg: dict) -> list[Figure]:
    """Each server's output tok/s, TTFT p50 and TPOT mean at each level, one run a
    repeat (`per_repeat`: each repeat's summaries by server, or one repeat's); the level
    is in the metric's name, so that ratios pair the same concurrency."""
    if isinstance(per_repeat, dict):
        per_repeat = [per_repeat]
    figures = []
    for name, reps in _by_server(per_repeat).items():
        engine = ("tokenmill" if name.startswith("tokenmill") else "vllm-cpu"
                  if name.startswith("vLLM") else "llama.cpp")
        for c_i, c in enumerate(levels):
            level = [summaries[c_i] for summaries in reps]
            config = {**cfg, "concurrency": c, "failed": sum(s["num_failed"] for s in level)}
            figures += [
                Figure(name, engine, f"output throughput c={c}", "tok/s",
                       [s["output_throughput_tok_s"] for s in level], True, config),
                Figure(name, engine, f"TTFT p50 c={c}", "ms",
                       [s["ttft_ms"]["p50"] for s in level], False, config),
                Figure(name, engine, f"TPOT mean c={c}", "ms",
                       [s["tpot_ms"]["mean"] for s in level], False, config)]
    return figures


if __name__ == "__main__":
    main()
