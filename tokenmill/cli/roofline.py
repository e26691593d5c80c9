"""`tokenmill roofline MODEL` and `tokenmill explain RESULT.json`.

Imports stay light: torch only for `--hardware cpu` or a GGUF/HF path, matplotlib only for
`--plot`.
"""

from __future__ import annotations

import argparse
import json
import sys

from tokenmill.roofline import fmt
from tokenmill.roofline.cost_model import KV_BYTES, RooflineReport, analyze, fleet_cost
from tokenmill.roofline.hardware import bandwidth_basis
from tokenmill.roofline.inputs import UsageError, load_hardware, load_model, weight_bits

DEFAULT_BATCHES = "1,8,32,64,128,256"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "roofline", help="the analytical floor of a model on a piece of hardware",
        description="Bytes and FLOPs per decode step, the step-time floor per batch size, KV "
        "bytes per token, the largest batch that fits, the prefill floor and $ per 1M tokens.")
    p.add_argument("model", help="preset name, config.json, HF checkpoint directory or .gguf")
    _add_hardware_args(p, default="h100-sxm")
    p.add_argument("--dtype", help="weight format: fp32, bf16, fp16, fp8, int8, int4, or a GGUF "
                   "type (q8_0, q4_k, q4_1, ...); default: the checkpoint's own")
    p.add_argument("--kv-dtype", default=None, choices=sorted(KV_BYTES),
                   help="KV cache dtype (default: bf16, fp32 for fp32 weights)")
    p.add_argument("--batch", default=DEFAULT_BATCHES,
                   help=f"comma-separated decode batch sizes (default {DEFAULT_BATCHES})")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--output-len", type=int, default=256, help="output tokens (default 256)")
    p.add_argument("--context", type=int, default=None, help="KV tokens each sequence holds in "
                   "a decode step (default: prompt-len + output-len, the worst case)")
    p.add_argument("--num-gpus", type=int, default=1, help="tensor-parallel devices (default 1)")
    p.add_argument("--fleet-gpus", type=int, help="print the cost of a fleet of N devices")
    p.add_argument("--hours", type=float, default=24.0, help="fleet hours (default 24)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plot", metavar="FILE.png", help="write a roofline chart")
    p.set_defaults(func=run_roofline)

    e = subparsers.add_parser(
        "explain", help="hold a measured bench/offline result against its roofline",
        description="Fraction of memory bandwidth reached in decode, MFU in prefill, the share "
        "of step time outside the model, the bottleneck and the next lever to try.")
    e.add_argument("result", help="a `tokenmill bench` (or offline run) result JSON")
    e.add_argument("--model", help="the model the run served (a preset name or a file), when "
                   "the result names one that is not a file here (default: the result's)")
    _add_hardware_args(e, default=None)
    e.add_argument("--json", action="store_true", help="print JSON instead of tables")
    e.add_argument("--plot", metavar="FILE.png", help="write a roofline chart with the "
                   "measured points")
    e.set_defaults(func=run_explain)


def _add_hardware_args(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--hardware", default=default, help="h100-sxm, h100-pcie, h200, a100-40gb, "
                   "a100-80gb, l4, l40s, a10g, mi300x, b200, rtx-4090, or cpu (measured here)"
                   + (f" (default {default})" if default else " (default: the result's, else cpu)"))
    p.add_argument("--bandwidth", type=float, metavar="GB/s", help="override memory bandwidth")
    p.add_argument("--flops", type=float, metavar="TFLOP/s",
                   help="override the peak FLOP/s of the compute dtype")
    p.add_argument("--cost-per-hour", type=float, metavar="$",
                   help="$ per device-hour (default: the catalog's)")
    p.add_argument("--remeasure", action="store_true",
                   help="--hardware cpu: measure this CPU's bandwidth and peaks again rather "
                   "than read them from ~/.cache/tokenmill/cpu_roofline.json (only a steady "
                   "measurement is cached)")


def _fail(command: str, message: str) -> int:
    print(f"tokenmill {command}: error: {message}", file=sys.stderr)
    return 2


# ---- shared ------------------------------------------------------------------------------


def _positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise UsageError(f"--{name} must be positive, got {value:g}")


def _parse_batches(text: str) -> list[int]:
    try:
        batches = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--batch takes comma-separated integers like 1,8,64, got {text!r}")
    if not batches or min(batches) < 1:
        raise UsageError(f"--batch sizes must be >= 1, got {text!r}")
    return sorted(set(batches))


# ---- roofline ----------------------------------------------------------------------------


def run_roofline(args: argparse.Namespace) -> int:
    try:
        report = build_roofline(args)
    except UsageError as e:
        return _fail("roofline", str(e))
    fleet = None
    if args.fleet_gpus is not None:
        per_hour = report.cost_per_hour / report.machine.num_gpus
        fleet = {"gpus": args.fleet_gpus, "hours": args.hours, "cost_per_gpu_hour": per_hour,
                 "cost": fleet_cost(args.fleet_gpus, args.hours, per_hour)}
    if args.plot:
        from tokenmill.roofline.plot import plot_roofline

        plot_roofline(args.plot, report)
    if args.json:
        print(json.dumps({**report.to_dict(), **({"fleet": fleet} if fleet else {})}, indent=2))
    else:
        print_roofline(report, fleet)
        if args.plot:
            print(f"roofline chart: {args.plot}")
    return 0


def build_roofline(args: argparse.Namespace) -> RooflineReport:
    batches = _parse_batches(args.batch)
    for name in ("prompt_len", "output_len", "context", "num_gpus", "fleet_gpus", "hours"):
        _positive(name.replace("_", "-"), getattr(args, name))
    model = load_model(args.model)
    bits = weight_bits(model, args.dtype)
    hardware = load_hardware(args.hardware, bits, args)
    kv_dtype = args.kv_dtype or ("fp32" if bits.compute_dtype == "fp32" else "bf16")
    context = args.context or args.prompt_len + args.output_len
    report = analyze(model.arch, bits, hardware, batches=batches, prompt_len=args.prompt_len,
                     output_len=args.output_len, context=context, kv_dtype=kv_dtype,
                     num_gpus=args.num_gpus, cost_per_hour=args.cost_per_hour)
    report.notes.extend(model.notes)
    return report


def print_roofline(report: RooflineReport, fleet: dict | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    m, hw = report.machine, report.hardware
    gpus = f" ×{m.num_gpus}" if m.num_gpus > 1 else ""
    active = (f" ({fmt.params(report.active_params)} active per token)"
              if report.active_params != report.total_params else "")
    console.print(f"[bold]{report.model}[/] on [bold]{hw.description}{gpus}[/]: "
                  f"weights {report.dtype}, KV cache {report.kv_dtype}")
    console.print(f"  parameters {fmt.params(report.total_params)}{active}, weights "
                  f"{fmt.num_bytes(report.weight_bytes)}; KV {report.kv_bytes_per_token:,.0f} "
                  f"bytes/token, {fmt.num_bytes(report.kv_bytes_per_sequence)} per sequence at "
                  f"{report.context:,} tokens")
    basis = f" ({bandwidth_basis(hw)})" if hw.name == "cpu" else ""  # its date and spread
    console.print(f"  bandwidth {fmt.si(m.bandwidth_bytes_s, 'B/s')}{basis}, "
                  f"peak {m.compute_dtype} "
                  f"{fmt.si(m.peak_flops, 'FLOP/s')}, ridge point {m.ridge_intensity:,.0f} "
                  f"FLOP/byte, {fmt.dollars(report.cost_per_hour)}/hour")
    console.print(f"  [dim]source: {hw.source}[/]")

    table = Table(title=f"Decode floor per step (each sequence at {report.context:,} tokens "
                  "of context)", title_justify="left")
    for col in ("batch", "bytes/step", "FLOPs/step", "FLOP/byte", "bound", "TPOT floor",
                "tok/s/user", "tok/s total", "$/1M out", "fits"):
        table.add_column(col, justify="left" if col == "bound" else "right")
    for row in report.rows:
        s = row.step
        table.add_row(str(row.batch), fmt.num_bytes(s.bytes), fmt.si(s.flops, "FLOP"),
                      f"{s.intensity:,.1f}", s.bound, fmt.ms(s.time_s), fmt.tok_s(row.tok_s_per_user),
                      fmt.tok_s(row.tok_s_total), fmt.dollars(row.cost_per_1m_output_tokens),
                      "yes" if row.fits else "[red]no[/]")
    console.print(table)

    p = report.prefill
    console.print(f"Prefill of {report.prompt_len:,} tokens: {fmt.si(p.flops, 'FLOP')}, "
                  f"{fmt.num_bytes(p.bytes)} moved, {p.intensity:,.0f} FLOP/byte → {p.bound}-"
                  f"bound, TTFT floor [bold]{fmt.ms(p.time_s)}[/]")
    if report.max_batch:
        console.print(f"Largest batch that fits at {report.context:,} tokens of context: "
                      f"[bold]{report.max_batch:,}[/] sequences (weights + KV within 90% of "
                      f"{fmt.num_bytes(m.memory_bytes)})")
    if report.rows:
        first = report.rows[0]
        e2e = p.time_s + (report.output_len - 1) * first.step.time_s
        console.print(f"One request alone at batch {first.batch}: TTFT {fmt.ms(p.time_s)} + "
                      f"{report.output_len - 1} × TPOT {fmt.ms(first.step.time_s)} = "
                      f"{fmt.ms(e2e)} end to end, at best")
    if fleet:
        console.print(f"Fleet: {fleet['gpus']:,} devices × {fleet['hours']:g} h × "
                      f"{fmt.dollars(fleet['cost_per_gpu_hour'])}/h = "
                      f"[bold]{fmt.dollars(fleet['cost'])}[/]")
    for note in report.notes:
        console.print(f"[yellow]note:[/] {note}")


# ---- explain -----------------------------------------------------------------------------


def run_explain(args: argparse.Namespace) -> int:
    from tokenmill.roofline.explain import explain, print_explanation

    try:
        result = _read_result(args.result)
    except UsageError as e:
        return _fail("explain", str(e))
    if result.get("pareto") and not args.json:  # a sweep: where its front bends
        from tokenmill.bench.pareto import describe_knee

        print(describe_knee(result["pareto"]))
    try:
        explanation = explain(result, args)
    except UsageError as e:
        return _fail("explain", str(e))
    if args.plot:
        from tokenmill.roofline.plot import plot_roofline

        plot_roofline(args.plot, explanation.roofline, measured=explanation.measured_points())
    if args.json:
        out = explanation.to_dict()
        if result.get("pareto"):
            from tokenmill.bench.pareto import describe_knee

            out["sweep_knee"] = {"point": result["pareto"]["knee"],
                                 "text": describe_knee(result["pareto"])}
        print(json.dumps(out, indent=2))
    else:
        print_explanation(explanation)
        if args.plot:
            print(f"roofline chart: {args.plot}")
    return 0


def _read_result(path: str) -> dict:
    try:
        with open(path) as f:
            result = json.load(f)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"{path} is not JSON: {e}") from None
    if not isinstance(result, dict) or not isinstance(result.get("config"), dict) or \
            not result["config"].get("model") or not isinstance(result.get("summary"), dict):
        raise UsageError(f"{path} is not a tokenmill bench result: it needs config.model and "
                         "summary")
    return result
