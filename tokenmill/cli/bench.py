"""`tokenmill bench`: load-test an OpenAI-compatible server, or the in-process engine."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
from typing import Any

from tokenmill.bench.metrics import METRIC_DEFINITIONS, SERVER_CLIENT_DEFINITIONS

EXAMPLES = """\
examples:
  # 64 requests of 128 prompt + 128 output tokens, 16 in flight
  tokenmill bench --base-url http://127.0.0.1:8000 --concurrency 16 --num-requests 64
  # Poisson arrivals at 4 req/s with SLOs and cost, results and plots saved
  tokenmill bench --base-url URL --request-rate 4 --slo ttft_ms=500 tpot_ms=50 \\
      --cost-per-hour 2.5 --output run.json --plot plots/
  # W2 of PERFORMANCE.md: fixed prompts file, one run per concurrency
  tokenmill bench --base-url URL --dataset jsonl --dataset-path w2_prompts_128.json \\
      --output-len 128 --num-requests 64 --sweep concurrency=1,4,16,32
  # the Pareto front of tok/s per user vs per device, one result file per point
  tokenmill bench sweep --base-url URL --concurrency 1,4,16,32 --slo tpot_ms=100 \\
      --output sweep.json --html sweep.html
  # 5 runs on each of two servers, A B B A: 95% intervals and B/A with its interval
  tokenmill bench --base-url URL_A --versus URL_B --repeats 5 --concurrency 16
  # the highest rate at which 90% of requests meet the SLOs
  tokenmill bench --base-url URL --max-rate-under-slo --slo ttft_ms=1000 tpot_ms=100
  # chat-app traffic: 16 conversations of 4 turns, each turn re-sending the history
  tokenmill bench --base-url URL --endpoint chat --dataset multiturn --turns 4 \\
      --input-len 64 --output-len 64 --num-requests 16 --concurrency 8
  # an agent: a 2,048-token tool prompt shared by all, 8 short turns per conversation
  tokenmill bench --base-url URL --endpoint chat --dataset agentic --prefix-len 2048 \\
      --input-len 32 --output-len 32 --num-requests 8 --concurrency 8
  # one HTML page with everything; then change one thing and compare the two runs
  tokenmill bench --base-url URL --concurrency 16 --output a.json --html a.html
  tokenmill bench --compare a.json b.json --html a_vs_b.html
  # a fast GPU server: 4 generator processes so one event loop is not the limit
  tokenmill bench --base-url URL --concurrency 256 --workers 4 --num-requests 2048
  # replay a Mooncake trace at twice its speed; the report shows the prefix-cache hits
  tokenmill bench --base-url URL --dataset trace --trace-path trace.jsonl --time-scale 0.5
  # the in-process engine, same workload and report, no HTTP
  tokenmill bench --offline smollm2-135m --input-len 32:512 --output-len 64:256
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="load-test an OpenAI-compatible server (or the engine in-process)",
        description="Load-test any OpenAI-compatible endpoint (tokenmill, vLLM, SGLang, "
        "llama.cpp) or, with --offline, the in-process engine: TTFT, TPOT, ITL, E2E "
        "percentiles, throughput, goodput under SLOs, $ per 1M tokens, tables, JSON and "
        "plots; the server's own view beside the client's, the client's own cost, an HTML "
        "report and side-by-side comparisons.\n\n" + METRIC_DEFINITIONS + "\n\n"
        + SERVER_CLIENT_DEFINITIONS + "\n\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", nargs="?", choices=["sweep"],
                   help="sweep: one run per value of a --concurrency or --request-rate list "
                   "(e.g. --concurrency 1,4,8), one result file per point, the Pareto front "
                   "of tok/s per user vs per device in the JSON, plots and HTML")
    t = p.add_argument_group("target")
    t.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:8000")
    t.add_argument("--model", help="model name sent in requests (default: the first model "
                   "the server lists at /v1/models)")
    t.add_argument("--lora-names", nargs="+", default=[], metavar="NAME",
                   help="a server's LoRA adapters, by served name: the requests name them as "
                   "their model, spread evenly (request i the (i mod n)-th; vLLM's bench "
                   "serve --lora-modules, which picks at random); the tokenizer stays the "
                   "base model's")
    t.add_argument("--offline", metavar="MODEL",
                   help="run the in-process engine on MODEL instead of a server")
    t.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions or /v1/chat/completions (default: completions)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    t.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for any chunk before a request times out")

    w = p.add_argument_group("workload")
    w.add_argument("--dataset", default="random",
                   choices=["random", "sharegpt", "prefix", "jsonl", "multiturn", "agentic",
                            "trace"],
                   help="multiturn and agentic (and sharegpt with --turns > 1) send "
                   "conversations: each turn's prompt is every earlier message plus the "
                   "server's reply; --num-requests then counts conversations")
    w.add_argument("--dataset-path", help="sharegpt JSON, or jsonl/JSON list of prompts")
    w.add_argument("--trace-path", help="trace dataset: a Mooncake-format JSONL trace "
                   "(timestamp ms, input_length, output_length, hash_ids); requests are sent "
                   "at its timestamps and shared hash ids become shared prompt prefixes")
    w.add_argument("--time-scale", type=float, default=1.0,
                   help="trace dataset: multiply the trace's timestamps (0.5 replays twice "
                   "as fast; default 1)")
    w.add_argument("--trace-block-size", type=int, default=512,
                   help="trace dataset: prompt tokens per hash id (Mooncake: 512)")
    w.add_argument("--input-len", default="128",
                   help="prompt tokens (random), suffix tokens (prefix) or tokens of each user "
                   "message (multiturn, agentic): N, LO:HI uniform, or normal:MEAN,STD "
                   "(default 128)")
    w.add_argument("--output-len", default=None,
                   help="output tokens, forced with max_tokens + ignore_eos: N, LO:HI or "
                   "normal:MEAN,STD (default 128; sharegpt/jsonl: the dataset's own when it "
                   "has them)")
    w.add_argument("--prefix-len", type=int, default=1024,
                   help="prefix dataset: tokens of each shared prefix; agentic: tokens of "
                   "the system (tool) prompt every conversation shares")
    w.add_argument("--num-prefixes", type=int, default=1,
                   help="prefix dataset: number of distinct shared prefixes")
    w.add_argument("--turns", type=int, default=None,
                   help="turns per conversation (multiturn: 4, agentic: 8; sharegpt: up to "
                   "N human turns of each conversation, default 1)")
    w.add_argument("--sharegpt-max-input-len", type=int, default=1024)
    w.add_argument("--sharegpt-max-total-len", type=int, default=2048)
    w.add_argument("--tokenizer", help="tokenizer for building prompts and counting tokens: "
                   "a tokenmill model name, a .gguf, or an HF dir (default: the served model)")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may stop early)")
    w.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON object merged into every request body")

    ld = p.add_argument_group("load")
    ld.add_argument("--concurrency", type=_number_list(int), default=None,
                    help="at most N requests in flight (default: unlimited); "
                    "`bench sweep`: a list, 1,4,8")
    ld.add_argument("--request-rate", type=_number_list(float), default=math.inf,
                    help="requests/s with gamma-distributed gaps (default inf: all at once); "
                    "`bench sweep`: a list, 1,2,4")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 steadier; "
                    "CV² of the gaps = 1/burstiness")
    ld.add_argument("--num-requests", type=int, default=None,
                    help="measured requests per run (default 64; with --duration: no cap)")
    ld.add_argument("--duration", type=float, default=None,
                    help="stop sending after this many seconds, cycling the prompts")
    ld.add_argument("--warmup", type=int, default=0,
                    help="requests sent (and left out of the statistics) before each run")
    ld.add_argument("--seed", type=int, default=0)
    ld.add_argument("--workers", type=int, default=1,
                    help="load-generator processes (default 1): the schedule is sharded "
                    "across them (request i goes to worker i mod N, each with its share of "
                    "--concurrency), all timestamp on one clock, results are merged")
    ld.add_argument("--sweep", metavar="KIND=V1,V2,...",
                    help="one run per value: rate=1,2,4 or concurrency=1,4,16,32")
    ld.add_argument("--repeats", type=int, default=1,
                    help="run the configuration N times: each metric's mean with a 95%% "
                    "interval (JSON: repeats.metrics.*.ci95); with --versus the servers "
                    "alternate A B B A and B/A gets its interval too")
    ld.add_argument("--versus", metavar="URL",
                    help="with --repeats: a second server (B) to compare --base-url (A) with, "
                    "same workload, runs interleaved")
    ld.add_argument("--max-rate-under-slo", action="store_true",
                    help="bisect for the highest request rate meeting --slo-attainment")
    ld.add_argument("--slo-attainment", type=float, default=90.0,
                    help="%% of requests that must meet every SLO (default 90)")
    ld.add_argument("--search-iterations", type=int, default=6)

    m = p.add_argument_group("metrics and output")
    m.add_argument("--slo", nargs="+", metavar="KEY=MS",
                   help="SLOs for goodput: ttft_ms=… tpot_ms=… e2e_ms=…")
    m.add_argument("--cost-per-hour", type=float, default=None, help="$ per hour per GPU")
    m.add_argument("--num-gpus", type=int, default=1)
    m.add_argument("--no-power", dest="power", action="store_false",
                   help="do not read this host's power (NVML on NVIDIA GPUs, RAPL on CPUs) "
                   "during each run")
    m.add_argument("--price-per-kwh", type=float, default=None,
                   help="$ per kWh: the measured energy's cost per 1M output tokens")
    m.add_argument("--hardware", help="recorded in the result for `tokenmill explain` "
                   "(e.g. h100, cpu; --offline: detected)")
    m.add_argument("--served-dtype", dest="dtype_label", default=None,
                   help="the server's weight dtype, recorded in the result (e.g. bfloat16)")
    m.add_argument("--output", help="write the result JSON here")
    m.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    m.add_argument("--html", metavar="FILE",
                   help="write one self-contained HTML report (plots embedded, no network); "
                   "with --compare: the comparison")
    m.add_argument("--compare", nargs="+", metavar="RESULT.json",
                   help="no run: compare result files side by side, each against the first "
                   "(console table; --html for a page)")
    m.add_argument("--no-progress", action="store_true")
    m.add_argument("--no-scrape", dest="scrape", action="store_false",
                   help="do not read the server's /metrics before, during and after each "
                   "run (the `server` section and the client-vs-server comparison)")
    m.add_argument("--scrape-interval", type=float, default=2.0,
                   help="seconds between /metrics scrapes during a run (default 2)")

    from tokenmill.cli.engine_args import add_engine_args

    e = p.add_argument_group("offline engine (with --offline)")
    holder = argparse.ArgumentParser(add_help=False)
    add_engine_args(holder, model_positional=False)
    for action in holder._actions:  # engine flags, minus --model/--seed (ours win)
        if action.dest in ("model", "seed") or not action.option_strings:
            continue
        e._add_action(action)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=False)
    err = Console(stderr=True)
    try:
        return _main(args, console, err)
    except (ValueError, FileNotFoundError) as e:
        err.print(f"[red]error:[/] {e}")
        return 2
    except ConnectionError as e:
        err.print(f"[red]error:[/] {e}\nis the server running?")
        return 1


def _main(args: argparse.Namespace, console, err) -> int:
    from tokenmill.bench import runner
    from tokenmill.bench.metrics import SLO
    from tokenmill.bench.report import (
        ProgressFactory,
        print_runs,
        print_summary,
        write_json,
    )
    from tokenmill.bench.workload import LengthSpec, WorkloadSpec, build_workload

    if args.compare:
        return _compare(args, console)
    if bool(args.base_url) == bool(args.offline):
        raise ValueError("give exactly one target: --base-url URL (a server) or "
                         "--offline MODEL (the in-process engine)")
    if args.offline and args.workers != 1:
        raise ValueError("--workers is for a server target: the offline engine runs in "
                         "this process")
    if args.offline and args.lora_names:
        raise ValueError("--lora-names is for a server target (its adapters by served "
                         "name)")
    slo = SLO.parse(args.slo)
    if args.max_rate_under_slo and slo is None:
        raise ValueError("--max-rate-under-slo needs --slo, e.g. --slo ttft_ms=500 tpot_ms=50")
    if args.max_rate_under_slo and args.sweep:
        raise ValueError("choose --sweep or --max-rate-under-slo, not both")
    sweep = _parse_sweep(args.sweep) if args.sweep else None
    sweep = _sweep_action(args, sweep)
    _check_trace_args(args, sweep)
    spec = WorkloadSpec(
        dataset=args.dataset, dataset_path=args.dataset_path,
        input_len=LengthSpec.parse(args.input_len),
        output_len=LengthSpec.parse(args.output_len or 128),
        output_len_from_dataset=args.output_len is None,
        num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
        sharegpt_max_input_len=args.sharegpt_max_input_len,
        sharegpt_max_total_len=args.sharegpt_max_total_len, turns=args.turns,
        trace_block_size=args.trace_block_size, time_scale=args.time_scale)
    if args.turns is not None and args.turns < 1:
        raise ValueError("--turns must be at least 1")
    if (args.turns or 1) > 1 and args.dataset not in ("sharegpt", "multiturn", "agentic"):
        raise ValueError("--turns needs a conversation dataset: multiturn, agentic or sharegpt")
    if args.offline and (args.dataset in ("multiturn", "agentic") or (args.turns or 1) > 1):
        raise ValueError("conversation workloads need a server (--base-url): the offline "
                         "target sends single requests only")
    if args.dataset_path and not os.path.exists(args.dataset_path):
        raise FileNotFoundError(f"--dataset-path {args.dataset_path} does not exist")
    num_requests = args.num_requests or (None if args.duration else 64)
    if args.dataset == "trace" and not args.num_requests:
        from tokenmill.bench.trace import load_trace

        num_requests = len(load_trace(args.dataset_path)) - args.warmup  # the whole trace

    target, config = _make_target(args, err)
    tokenizer = target.tokenizer
    config["workload"] = spec.as_dict()
    pool = num_requests or 1000  # --duration without --num-requests: cycle 1000 prompts

    def make_requests(run_index: int):
        return build_workload(spec, args.warmup + pool, tokenizer, args.seed, run_index)

    plan = runner.BenchPlan(
        target=target, config=config, make_requests=make_requests, warmup=args.warmup,
        request_cap=args.num_requests if args.duration else None, seed=args.seed, slo=slo,
        cost_per_hour=args.cost_per_hour, num_gpus=args.num_gpus,
        progress=ProgressFactory(console, enabled=not args.no_progress),
        scraper=_make_scraper(args), power=args.power, price_per_kwh=args.price_per_kwh)
    base = runner.LoadSpec(concurrency=args.concurrency, request_rate=args.request_rate,
                           burstiness=args.burstiness, duration_s=args.duration)
    if args.repeats > 1 or args.versus:
        result = _run_repeats(args, plan, base, sweep, err)
    elif sweep:
        result = runner.run_sweep(plan, base, *sweep)
    elif args.max_rate_under_slo:
        start = args.request_rate if math.isfinite(args.request_rate) else 1.0
        result = runner.search_max_rate(
            plan, base, args.slo_attainment, start_rate=start,
            iterations=args.search_iterations,
            on_probe=lambda p: console.print(
                f"  rate {p['request_rate']:.3g} req/s: attainment "
                f"{p['slo_attainment']:.1f}% -> {'pass' if p['passed'] else 'fail'}"))
    else:
        result = runner.run_once(plan, base)
    if plan.scraper is not None:
        plan.scraper.close()

    print_summary(console, result)
    if "runs" in result:
        print_runs(console, result)
    if "repeats" in result:
        from tokenmill.bench.repeats import print_repeats

        print_repeats(console, result, (args.base_url or "A", args.versus or "B"))
    if args.output:
        write_json(result, args.output)
        console.print(f"results: {args.output}")
        if args.action == "sweep":
            from tokenmill.bench.sweep_files import write_points

            for path in write_points(result, args.output):
                console.print(f"  point: {path}")
    if result.get("pareto"):
        from tokenmill.bench.pareto import describe_knee

        console.print(describe_knee(result["pareto"]))
    if args.html:
        from tokenmill.bench.html_report import render_report, write_html

        write_html(render_report(result), args.html)
        console.print(f"report: {args.html}")
    if args.plot:
        from tokenmill.bench.plots import write_plots

        for path in write_plots(result, args.plot):
            console.print(f"plot: {path}")
    return _exit_code(result, err)


def _compare(args: argparse.Namespace, console) -> int:
    from pathlib import Path

    from tokenmill.bench.compare import load_results, print_compare

    results = load_results(args.compare)
    names = [Path(p).stem for p in args.compare]
    if len(set(names)) < len(names):  # same file names in different folders
        names = list(args.compare)
    print_compare(console, names, results)
    if args.html:
        from tokenmill.bench.html_report import render_comparison, write_html

        write_html(render_comparison(names, results), args.html)
        console.print(f"report: {args.html}")
    return 0


def _run_repeats(args: argparse.Namespace, plan, base, sweep, err) -> dict[str, Any]:
    """--repeats N [--versus URL]: the runs, the A result on top, B's under `versus`."""
    from dataclasses import replace

    from tokenmill.bench import runner
    from tokenmill.bench.repeats import run_repeats

    if args.repeats < 2:
        raise ValueError("--versus needs --repeats N (N >= 2): one run each is an anecdote")
    if sweep or args.max_rate_under_slo or args.duration:
        raise ValueError("--repeats runs one configuration: not with --sweep, "
                         "--max-rate-under-slo or --duration")
    plans = [plan]
    if args.versus:
        if args.offline:
            raise ValueError("--versus compares two servers: use --base-url, not --offline")
        b_args = argparse.Namespace(**{**vars(args), "base_url": args.versus,
                                       "model": None})  # B: the first model it lists
        target, config = _make_target(b_args, err)
        plans.append(replace(plan, target=target,
                             config={**config, "workload": plan.config["workload"]},
                             scraper=_make_scraper(b_args)))
    rep = run_repeats(lambda server, k: runner.run_once(plans[server], base, run_index=k),
                      args.repeats, num_servers=len(plans))
    runs_a = rep.pop("runs_by_server")
    result = runner.combine(plan, runs_a[0], rep)
    if args.versus:
        result["repeats"]["versus"]["base_url"] = args.versus
        result["versus_runs"] = runs_a[1]
        if plans[1].scraper is not None:
            plans[1].scraper.close()
    return result


def _check_trace_args(args: argparse.Namespace, sweep) -> None:
    """The trace flags belong to the trace dataset, whose timestamps are the arrivals."""
    if args.dataset != "trace":
        for flag, default in (("trace_path", None), ("time_scale", 1.0),
                              ("trace_block_size", 512)):
            if getattr(args, flag) != default:
                raise ValueError(f"--{flag.replace('_', '-')} is for --dataset trace")
        return
    if not args.trace_path and not args.dataset_path:
        raise ValueError("--dataset trace needs --trace-path FILE.jsonl (Mooncake format)")
    if args.trace_path and args.dataset_path:
        raise ValueError("give --trace-path or --dataset-path, not both")
    args.dataset_path = args.trace_path or args.dataset_path
    if math.isfinite(args.request_rate) or (sweep and sweep[0] == "rate") \
            or args.max_rate_under_slo:
        raise ValueError("--dataset trace sends at the trace's timestamps: use --time-scale "
                         "instead of --request-rate (or a rate sweep/search)")
    if args.offline:
        raise ValueError("--dataset trace needs a server (--base-url): the offline target "
                         "does not honour arrival times")


def _exit_code(result: dict[str, Any], err) -> int:
    """Non-zero when the server died or could not be reached, or nothing completed."""
    runs = result.get("runs") or [result]
    lost = sum(r["summary"]["connection_failures"] for r in runs)
    total = sum(r["summary"]["num_requests"] for r in runs)
    done = sum(r["summary"]["num_completed"] for r in runs)
    if lost:
        kinds: dict[str, int] = {}
        for r in runs:
            for k, v in r["summary"]["failures"].items():
                kinds[k] = kinds.get(k, 0) + v
        err.print(f"[red]error:[/] {lost} of {total} requests failed because the server "
                  f"was unreachable or dropped the connection "
                  f"({', '.join(f'{k}: {v}' for k, v in kinds.items())}); did the server die? "
                  f"the statistics above include these failures")
        return 1
    if total and not done:
        err.print("[red]error:[/] no request completed; see the failures above")
        return 1
    return 0


def _number_list(kind):
    """`16` → [16]; `1,4,8` → [1, 4, 8] (a list is for `bench sweep`)."""

    def parse(text: str) -> list:
        try:
            vals = [kind(v) for v in str(text).split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}") from None
        if not vals:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}")
        return vals

    parse.__name__ = kind.__name__
    return parse


def _sweep_action(args: argparse.Namespace, sweep):
    """`bench sweep --concurrency 1,4,8` → ("concurrency", [1, 4, 8]); the lists become
    single values again for everything else."""
    conc = args.concurrency or [None]
    rate = args.request_rate if isinstance(args.request_rate, list) else [args.request_rate]
    if args.action != "sweep":
        for flag, vals in (("--concurrency", conc), ("--request-rate", rate)):
            if len(vals) > 1:
                raise ValueError(f"{flag} takes one value; a list of them is a sweep: "
                                 f"`tokenmill bench sweep {flag} {','.join(map(str, vals))}`")
        args.concurrency, args.request_rate = conc[0], rate[0]
        return sweep
    if sweep or args.max_rate_under_slo:
        raise ValueError("`bench sweep` takes its values from --concurrency or "
                         "--request-rate lists: not with --sweep or --max-rate-under-slo")
    if len(conc) > 1 and len(rate) > 1:
        raise ValueError("`bench sweep`: give a list to --concurrency or to --request-rate, "
                         "not both")
    if len(rate) > 1 or (conc == [None] and math.isfinite(rate[0])):
        args.concurrency, args.request_rate = conc[0], math.inf
        return "rate", [float(r) for r in rate]
    if conc == [None]:
        raise ValueError("`bench sweep` needs a list: --concurrency 1,4,8 or "
                         "--request-rate 1,2,4")
    args.concurrency, args.request_rate = None, rate[0]
    return "concurrency", conc


def _parse_sweep(text: str) -> tuple[str, list[float]]:
    kind, sep, values = text.partition("=")
    kind = {"rate": "rate", "request_rate": "rate", "request-rate": "rate",
            "concurrency": "concurrency"}.get(kind.strip())
    try:
        vals = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not sep or kind is None or not vals:
        raise ValueError(f"invalid --sweep {text!r}; use rate=1,2,4 or concurrency=1,4,16")
    if kind == "concurrency":
        vals = [int(v) for v in vals]
    return kind, vals


def _make_target(args: argparse.Namespace, err) -> tuple[Any, dict[str, Any]]:
    from tokenmill.bench.runner import HttpTarget

    if args.offline:
        from tokenmill.bench.offline import OfflineTarget
        from tokenmill.cli.engine_args import engine_config_from_args

        args.model = args.offline
        target = OfflineTarget(engine_config_from_args(args), temperature=args.temperature,
                               ignore_eos=args.ignore_eos)
        # what the engine resolved "auto" to (gguf-a8 / gguf-a16 on a GGUF file): explain's weights
        quantization = target.quantization or args.quantization
        engine_args = {k: getattr(args, k, None) for k in (
            "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
            "enable_prefix_caching", "device", "kv_cache_dtype")}
        config = {"model": args.offline, "base_url": None, "endpoint": "engine.step",
                  "backend": "offline", "dtype": target.dtype, "quantization": quantization,
                  "quantization_reason": target.quantization_reason,
                  "hardware": args.hardware or target.hardware,
                  "engine_args": {**engine_args, "quantization": quantization}}
        return target, config
    from tokenmill.bench.client import ClientOptions, fetch_model_name
    from tokenmill.bench.target_config import fetch_server_config

    model = getattr(args, "model", None) or asyncio.run(fetch_model_name(args.base_url,
                                                                         args.api_key))
    tokenizer = load_bench_tokenizer(args.tokenizer or model, explicit=bool(args.tokenizer),
                                     err=err)
    options = ClientOptions(base_url=args.base_url, model=model, endpoint=args.endpoint,
                            api_key=args.api_key, temperature=args.temperature,
                            ignore_eos=args.ignore_eos, extra_body=args.extra_body,
                            timeout_s=args.timeout, lora_modules=list(args.lora_names))
    config = {"model": model, "base_url": args.base_url, "endpoint": args.endpoint,
              "lora_names": list(args.lora_names) or None,
              "backend": "openai", "dtype": args.dtype_label, "hardware": args.hardware,
              "tokenizer": args.tokenizer or model, "extra_body": args.extra_body or None,
              # what the server says it runs (issue 22: explain skips levers already pulled)
              "server_config": asyncio.run(fetch_server_config(args.base_url, args.api_key))}
    if args.workers < 1:
        raise ValueError("--workers must be at least 1")
    config["workers"] = args.workers
    return HttpTarget(options, tokenizer, workers=args.workers), config


def _make_scraper(args: argparse.Namespace) -> Any:
    if args.offline or not args.scrape:
        return None
    from tokenmill.bench.server_metrics import MetricsScraper

    return MetricsScraper(args.base_url, args.api_key, interval_s=args.scrape_interval)


def load_bench_tokenizer(name: str, explicit: bool, err) -> Any:
    """tokenmill's own resolution (model names, GGUF, HF dirs), then transformers (the HF
    hub only when asked for by --tokenizer); None, with a warning, when nothing resolves
    and the user did not name a tokenizer."""
    try:
        from tokenmill.loaders.model_source import resolve_model
        from tokenmill.loaders.tokenizer import load_tokenizer

        return load_tokenizer(resolve_model(name))
    except Exception as first:  # noqa: BLE001 — fall back, then report the first cause
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(name, local_files_only=not explicit)
        except Exception:  # noqa: BLE001
            if explicit:
                raise ValueError(f"cannot load tokenizer {name!r}: {first}") from first
            err.print(f"[yellow]warning:[/] no tokenizer for {name!r} ({first}); token "
                      f"counts come from server usage only. Pass --tokenizer for exact "
                      f"prompt lengths and client-side counts.")
            return None
