"""A measured run held against its floor: how far from the hardware, why, and what to try next.

Reads a `tokenmill bench` result (or an offline run's JSON with an `engine` section). Only
`config.model` and `summary` are required; every other field is optional:

  config.model, config.dtype, config.quantization, config.hardware
  summary.output_throughput_tok_s, total_throughput_tok_s, request_throughput,
          mean_in_flight, mean_input_tokens, mean_output_tokens,
          ttft_ms / tpot_ms / itl_ms / e2e_ms  ({mean, std, p50, p90, p95, p99, max})
  engine.num_steps, engine.time_s.{schedule, prepare, forward, sample, postprocess},
         engine.num_prefill_tokens, engine.num_decode_tokens, engine.mean_decode_batch,
         engine.wall_time_s
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from tokenmill.roofline import fmt
from tokenmill.roofline.arch import ModelArch, WeightBits
from tokenmill.roofline.cost_model import (
    Machine,
    RooflineReport,
    StepFloor,
    analyze,
    decode_step,
    prefill_step,
)
from tokenmill.roofline.hardware import ALIASES, CATALOG
from tokenmill.roofline.inputs import UsageError, load_hardware, load_model, weight_bits

OVERHEAD_BOUND_SHARE = 0.30  # host work above this share of step time is the bottleneck
NEAR_FLOOR = 0.50
HOST_FIXES = {  # step phase -> what usually shrinks it
    "sample": "faster sampling: one batched pass (greedy fast path, top-k before softmax), "
              "on the device",
    "prepare": "cheaper input preparation: update step tensors incrementally, reuse buffers",
    "schedule": "cheaper scheduling: no per-step Python loops over every sequence",
    "postprocess": "cheaper postprocess: incremental detokenization, batched stop checks",
}  # a decode reaching this share of bandwidth is bandwidth-bound, not overhead


@dataclass
class Lever:
    name: str
    why: str


@dataclass(frozen=True)
class _Run:
    """What the measured run was: model, weights, machine, decode batch and context."""

    arch: ModelArch
    bits: WeightBits
    report: RooflineReport
    batch: float
    context: int
    kv_bytes_per_element: float

    @property
    def machine(self) -> Machine:
        return self.report.machine

    def decode_floor(self, bits: WeightBits, batch: float) -> StepFloor:
        return decode_step(self.arch, bits, self.machine, batch, self.context,
                           self.kv_bytes_per_element)

    def floor_tok_s(self, bits: WeightBits, batch: float) -> float:
        return batch / self.decode_floor(bits, batch).time_s


@dataclass
class Explanation:
    source: str
    hardware_name: str
    roofline: RooflineReport
    decode: dict | None
    prefill: dict | None
    engine: dict | None
    bottleneck: str
    levers: list[Lever]
    notes: list[str] = field(default_factory=list)

    def measured_points(self) -> list[tuple[str, float, float]]:
        """(label, arithmetic intensity, achieved FLOP/s) for the plot."""
        points = []
        if self.decode:
            d = self.decode
            points.append(((f"measured decode, batch {d['batch']:.3g}: "
                           f"{d['measured_step_ms']:.3g} ms/step"), d["arithmetic_intensity"],
                           d["achieved_flops_s"]))
        if self.prefill:
            p = self.prefill
            points.append((f"measured prefill (TTFT p50): {p['measured_ttft_ms']:,.0f} ms",
                           p["arithmetic_intensity"], p["achieved_flops_s"]))
        if self.engine and "achieved_flops_s" in self.engine:
            e = self.engine
            points.append((f"measured forward, whole run: {e['time_s']['forward']:.3g} s",
                           e["arithmetic_intensity"], e["achieved_flops_s"]))
        return points

    def to_dict(self) -> dict:
        r = self.roofline
        return {
            "source": self.source, "model": r.model, "hardware": self.hardware_name,
            "dtype": r.dtype, "memory_bandwidth_bytes_s": r.machine.bandwidth_bytes_s,
            "peak_flops": r.machine.peak_flops, "decode": self.decode, "prefill": self.prefill,
            "engine": self.engine, "bottleneck": self.bottleneck,
            "next_lever": self.levers[0].__dict__ if self.levers else None,
            "levers": [lever.__dict__ for lever in self.levers], "notes": self.notes,
        }


def _num(d: dict | None, *path: str) -> float | None:
    for key in path:
        if not isinstance(d, dict) or d.get(key) is None:
            return None
        d = d[key]
    return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def _hardware_name(args: argparse.Namespace, config: dict, notes: list[str]) -> str:
    if args.hardware:
        return args.hardware
    recorded = config.get("hardware")
    if not recorded:
        notes.append("the result names no hardware: held against this CPU (pass --hardware)")
        return "cpu"
    text = "".join(c for c in str(recorded).lower() if c.isalnum())
    if text == "cpu" or text.startswith("cpu"):
        return "cpu"
    if "a100" in text and "40gb" in text:
        return "a100-40gb"
    names = sorted([*CATALOG, *ALIASES], key=len, reverse=True)  # l40s before l4
    for name in names:
        if name.replace("-", "") in text:
            return name
    raise UsageError(f"the result's hardware {recorded!r} is not in the catalog; pass "
                     f"--hardware ({', '.join([*CATALOG, 'cpu'])})")


def _weight_bits(model, config: dict) -> WeightBits:
    for key in ("quantization", "dtype"):
        value = config.get(key)
        if value and str(value).lower() not in ("none", "auto"):
            try:
                return weight_bits(model, str(value))
            except UsageError:
                continue  # e.g. an engine-specific label: fall back to the checkpoint's own
    return model.default_bits


def explain(result: dict, args: argparse.Namespace) -> Explanation:
    config, summary = result["config"], result["summary"]
    engine = result.get("engine") if isinstance(result.get("engine"), dict) else None
    notes: list[str] = []
    model = load_model(str(config["model"]))
    bits = _weight_bits(model, config)
    hw_name = _hardware_name(args, config, notes)
    hardware = load_hardware(hw_name, bits, args)
    arch = model.arch

    batch = _num(engine, "mean_decode_batch") or _num(summary, "mean_in_flight") or 1.0
    batch = max(1.0, batch)
    prompt = _num(summary, "mean_input_tokens")
    output = _num(summary, "mean_output_tokens")
    if prompt is None:
        notes.append("no summary.mean_input_tokens: prefill assumed 512 tokens")
    prompt_len = max(1, round(prompt or 512))
    output_len = max(1, round(output or 256))
    context = max(1, round(prompt_len + output_len / 2))  # mean KV length over the decode
    kv_dtype = "fp32" if bits.compute_dtype == "fp32" else "bf16"
    batches = sorted({1, 8, 32, 64, 128, 256, max(1, round(batch))})
    report = analyze(arch, bits, hardware, batches=batches, prompt_len=prompt_len,
                     output_len=output_len, context=context, kv_dtype=kv_dtype,
                     cost_per_hour=args.cost_per_hour)
    kv_bpe = report.kv_bytes_per_token / arch.kv_bytes_per_token(1)
    run = _Run(arch, bits, report, batch, context, kv_bpe)
    machine = report.machine

    decode = None
    floor = run.decode_floor(bits, batch)
    step_ms = _num(summary, "tpot_ms", "mean") or _num(summary, "itl_ms", "mean")
    out_tps = _num(summary, "output_throughput_tok_s")
    if step_ms is None and out_tps:
        step_ms = batch / out_tps * 1e3
        notes.append("no TPOT/ITL: decode step time taken as batch ÷ output throughput")
    if step_ms:
        step_s = step_ms / 1e3
        decode = {
            "batch": batch, "context": context, "measured_step_ms": step_ms,
            "floor_step_ms": floor.time_s * 1e3, "bound": floor.bound,
            "bytes_per_step": floor.bytes, "weight_bytes_per_step": floor.weight_bytes,
            "kv_bytes_per_step": floor.kv_bytes, "flops_per_step": floor.flops,
            "arithmetic_intensity": floor.intensity,
            "achieved_bandwidth_bytes_s": floor.bytes / step_s,
            "bandwidth_fraction": floor.memory_time_s / step_s,
            "achieved_flops_s": floor.flops / step_s,
            "mfu": floor.compute_time_s / step_s,
            "fraction_of_floor": floor.time_s / step_s,
        }

    prefill = None
    pre = prefill_step(arch, bits, machine, prompt_len, kv_bpe)
    ttft_ms = _num(summary, "ttft_ms", "p50") or _num(summary, "ttft_ms", "mean")
    if ttft_ms and prompt is not None:
        ttft_s = ttft_ms / 1e3
        prefill = {
            "prompt_tokens": prompt_len, "measured_ttft_ms": ttft_ms,
            "floor_ttft_ms": pre.time_s * 1e3, "bound": pre.bound, "flops": pre.flops,
            "arithmetic_intensity": pre.intensity, "achieved_flops_s": pre.flops / ttft_s,
            "mfu": pre.compute_time_s / ttft_s, "fraction_of_floor": pre.time_s / ttft_s,
        }
        notes.append("prefill MFU uses TTFT p50, which includes queueing and any decode steps "
                     "it shared: a lower bound on the kernel's own MFU")

    engine_view = _engine_view(engine, arch, bits, machine, context, prompt_len, kv_bpe)
    if any(part and part.get("fraction_of_floor", 0) > 1.05
           for part in (decode, prefill, engine_view)):
        notes.append("a measured time beats its floor: the hardware figures are too low "
                     "(a contended CPU micro-benchmark?); pass --bandwidth / --flops")
    bottleneck, levers = _diagnose(run, decode, prefill, engine_view, summary, hw_name)
    return Explanation(str(args.result), hw_name, report, decode, prefill, engine_view,
                       bottleneck, levers, notes + report.notes + list(model.notes))


def _engine_view(engine, arch, bits, machine, context, prompt_len, kv_bpe) -> dict | None:
    times = engine.get("time_s") if engine else None
    if not isinstance(times, dict) or not _num(times, "forward"):
        return None
    parts = {k: float(v) for k, v in times.items() if isinstance(v, (int, float))}
    step_total = sum(parts.values())
    forward = parts["forward"]
    view: dict = {
        "time_s": parts,
        "step_time_s": step_total,
        "forward_share": forward / step_total,
        "overhead_share": (step_total - forward) / step_total,
        "overhead_split": {k: v / step_total for k, v in parts.items() if k != "forward"},
    }
    wall = _num(engine, "wall_time_s")
    if wall:
        view["outside_step_share"] = max(0.0, wall - step_total) / wall
    steps = _num(engine, "num_steps")
    n_pre = _num(engine, "num_prefill_tokens") or 0.0
    n_dec = _num(engine, "num_decode_tokens") or 0.0
    if steps and n_pre + n_dec > 0:
        per_prompt = prefill_step(arch, bits, machine, prompt_len, kv_bpe)
        per_decode = decode_step(arch, bits, machine, 1, context, kv_bpe)
        tokens_per_step = (n_pre + n_dec) / steps
        flops = n_pre / prompt_len * per_prompt.flops + n_dec * per_decode.flops
        moved = (steps * bits.bytes_read_per_step(arch, tokens_per_step)
                 + n_dec * per_decode.kv_bytes + n_pre / prompt_len * per_prompt.kv_bytes)
        floor_s = max(moved / machine.bandwidth_bytes_s, flops / machine.peak_flops)
        view.update({
            "forward_floor_s": floor_s, "fraction_of_floor": floor_s / forward,
            "arithmetic_intensity": flops / moved, "achieved_flops_s": flops / forward,
            "bandwidth_fraction": moved / forward / machine.bandwidth_bytes_s,
            "mfu": flops / forward / machine.peak_flops,
        })
    return view


def _diagnose(run: _Run, decode, prefill, engine, summary, hw_name) -> tuple[str, list[Lever]]:
    report, bits, batch = run.report, run.bits, run.batch
    levers: list[Lever | None] = []
    gpu = hw_name != "cpu"
    fuse = ("CUDA graphs (capture the decode step; one launch instead of hundreds)" if gpu
            else "fewer, fused ops per step (torch.compile or fused kernels)")

    if engine and engine["overhead_share"] >= OVERHEAD_BOUND_SHARE:
        split = ", ".join(f"{k} {fmt.pct(v)}" for k, v in
                          sorted(engine["overhead_split"].items(), key=lambda kv: -kv[1]))
        bottleneck = (f"host overhead: {fmt.pct(engine['overhead_share'])} of step time is "
                      f"outside the model forward ({split})")
        worst = max(engine["overhead_split"].items(), key=lambda kv: kv[1])
        levers.append(Lever(HOST_FIXES.get(worst[0], f"cut {worst[0]} time"),
                            f"{worst[0]} alone is {fmt.pct(worst[1])} of step time, paid "
                            "once per step whatever the batch"))
        levers.append(_bigger_batch(run, "amortizes the per-step host work"))
    elif decode and _decode_loses_more(decode, prefill, summary):
        bw, mfu = decode["bandwidth_fraction"], decode["mfu"]
        m, f = decode["measured_step_ms"], decode["floor_step_ms"]
        use = (f"{fmt.pct(bw)} of memory bandwidth" if decode["bound"] == "memory"
               else f"{fmt.pct(mfu)} of peak FLOP/s")
        if decode["fraction_of_floor"] < NEAR_FLOOR:
            bottleneck = (f"decode is overhead-bound: TPOT {m:.3g} ms is {m / f:.1f}× its "
                          f"{f:.3g} ms floor ({decode['bound']}-bound at batch {batch:.3g}); "
                          f"it uses only {use}")
            levers.append(Lever(fuse, f"{m - f:.3g} ms of every {m:.3g} ms step is neither "
                                "moving bytes nor doing math at full rate: per-op launch, "
                                "Python and slow kernels"))
            levers.append(_bigger_batch(run, "the same per-step overhead serves more tokens"))
            levers.append(_quantize(run, decode))
        elif decode["bound"] == "memory":
            bottleneck = (f"decode is memory-bandwidth-bound: {use} at batch {batch:.3g} "
                          f"(TPOT {m:.3g} ms, floor {f:.3g} ms)")
            levers.append(_bigger_batch(run, "weights are read once per step for "
                                        "the whole batch"))
            levers.append(_quantize(run, decode))
            levers.append(_kv_fp8(decode))
            if batch <= 4:
                levers.append(Lever("speculative decoding", f"at batch {batch:.3g} a step does "
                                    f"{decode['arithmetic_intensity']:.3g} FLOP/byte against a "
                                    f"ridge of {report.machine.ridge_intensity:,.0f}: verifying "
                                    "4 draft tokens per step costs about the same bytes"))
        else:
            bottleneck = (f"decode is compute-bound at batch {batch:.3g}: {use} "
                          f"(TPOT {m:.3g} ms, floor {f:.3g} ms)")
            if bits.compute_dtype != "fp8" and "fp8" in report.hardware.peak_flops:
                levers.append(Lever("fp8 weights and activations", "doubles peak FLOP/s on "
                                    f"{report.hardware.name}"))
            levers.append(Lever("smaller batch for latency", "past the ridge point a bigger "
                                "batch adds TPOT without adding throughput"))
    elif prefill:
        t, f = prefill["measured_ttft_ms"], prefill["floor_ttft_ms"]
        bottleneck = (f"prefill: TTFT p50 {t:,.0f} ms against a {f:.3g} ms floor for "
                      f"{prefill['prompt_tokens']:,} tokens ({fmt.pct(prefill['mfu'])} MFU)")
        levers.extend(_prefill_levers(prefill, summary))
    else:
        bottleneck = "not enough measurements to name one (no TPOT, ITL, TTFT or throughput)"
    found = [lever for lever in levers if lever is not None]
    if prefill and not any(lever.name.startswith(("chunked", "prefix")) for lever in found):
        found.extend(_prefill_levers(prefill, summary))
    return bottleneck, found


def _decode_loses_more(decode, prefill, summary) -> bool:
    """Whether decode loses more time per request against its floor than prefill does."""
    if not prefill:
        return True
    outputs = max(1.0, (_num(summary, "mean_output_tokens") or 2.0) - 1)
    decode_lost = (decode["measured_step_ms"] - decode["floor_step_ms"]) * outputs
    prefill_lost = prefill["measured_ttft_ms"] - prefill["floor_ttft_ms"]
    return decode_lost >= prefill_lost


def _bigger_batch(run: _Run, reason: str) -> Lever | None:
    target = min(run.report.max_batch, max(8, 4 * round(run.batch)))
    if target <= run.batch * 1.5:
        return None
    now, then = run.floor_tok_s(run.bits, run.batch), run.floor_tok_s(run.bits, target)
    if then < 1.2 * now:  # past the ridge: more sequences add latency, not throughput
        return None
    return Lever(f"bigger batch ({run.batch:.3g} → {target})",
                 f"{reason}: floor throughput {fmt.tok_s(now)} → {fmt.tok_s(then)} tok/s; KV for "
                 f"{run.report.max_batch:,} sequences of {run.context:,} tokens fits")


def _quantize(run: _Run, decode: dict) -> Lever | None:
    share = decode["weight_bytes_per_step"] / decode["bytes_per_step"]
    if run.bits.linear <= 5.0 or share < 0.5:
        return None
    target = "int8" if run.bits.linear > 8.5 else "int4"
    new = run.decode_floor(WeightBits.from_name(target), run.batch)
    if new.time_s > 0.9 * decode["floor_step_ms"] / 1e3:  # compute-bound: bytes don't matter
        return None
    return Lever(f"{target} weights", f"weights are {fmt.pct(share)} of the bytes a step reads: "
                 f"{fmt.num_bytes(decode['weight_bytes_per_step'])} → "
                 f"{fmt.num_bytes(new.weight_bytes)}, TPOT floor "
                 f"{decode['floor_step_ms']:.3g} → {new.time_s * 1e3:.3g} ms")


def _kv_fp8(decode) -> Lever | None:
    share = decode["kv_bytes_per_step"] / decode["bytes_per_step"]
    if share < 0.5:
        return None
    return Lever("fp8 KV cache", f"KV reads are {fmt.pct(share)} of step bytes; fp8 halves them")


def _prefill_levers(prefill, summary) -> list[Lever]:
    levers = []
    itl50, itl99 = _num(summary, "itl_ms", "p50"), _num(summary, "itl_ms", "p99")
    if itl50 and itl99 and itl99 > 3 * itl50:
        levers.append(Lever("chunked prefill", f"ITL p99 {itl99:.3g} ms is {itl99 / itl50:.1f}× "
                            f"p50 {itl50:.3g} ms: whole prompts stall running decodes"))
    e2e = _num(summary, "e2e_ms", "mean")
    ttft = prefill["measured_ttft_ms"]
    if e2e and ttft / e2e > 0.2:
        levers.append(Lever("prefix caching (if prompts share a prefix)",
                            f"TTFT is {fmt.pct(ttft / e2e)} of end-to-end latency; a cached "
                            f"prefix skips its share of the {prefill['prompt_tokens']:,}-token "
                            "prefill"))
    if prefill["mfu"] < 0.3 and prefill["bound"] == "compute":
        levers.append(Lever("faster prefill kernels", f"prefill reaches {fmt.pct(prefill['mfu'])}"
                            " MFU: bf16 matmuls over the whole prompt, one attention call"))
    return levers


def print_explanation(ex: Explanation) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    r, m = ex.roofline, ex.roofline.machine
    console.print(f"[bold]{ex.source}[/]: {r.model} ({r.dtype} weights) on "
                  f"{r.hardware.description}")
    console.print(f"  floor from bandwidth {fmt.si(m.bandwidth_bytes_s, 'B/s')}, peak "
                  f"{m.compute_dtype} {fmt.si(m.peak_flops, 'FLOP/s')}")
    console.print(f"  [dim]source: {r.hardware.source}[/]")
    table = Table(title="Measured vs floor", title_justify="left")
    for col in ("phase", "measured", "floor", "of floor", "bandwidth used", "MFU"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    if ex.decode:
        d = ex.decode
        table.add_row(f"decode step (TPOT), batch {d['batch']:.3g}, {d['context']:,} tokens ctx",
                      f"{d['measured_step_ms']:.3g} ms", f"{d['floor_step_ms']:.3g} ms",
                      fmt.pct(d["fraction_of_floor"]), fmt.pct(d["bandwidth_fraction"]),
                      fmt.pct(d["mfu"]))
    if ex.prefill:
        p = ex.prefill
        table.add_row(f"prefill (TTFT p50), {p['prompt_tokens']:,} tokens",
                      f"{p['measured_ttft_ms']:,.4g} ms", f"{p['floor_ttft_ms']:.3g} ms",
                      fmt.pct(p["fraction_of_floor"]), "", fmt.pct(p["mfu"]))
    e = ex.engine
    if e and "forward_floor_s" in e:
        table.add_row("engine forward, whole run", f"{e['time_s']['forward']:.3g} s",
                      f"{e['forward_floor_s']:.3g} s", fmt.pct(e["fraction_of_floor"]),
                      fmt.pct(e["bandwidth_fraction"]), fmt.pct(e["mfu"]))
    if table.row_count:
        console.print(table)
    if e:
        split = ", ".join(f"{k} {fmt.pct(v)}" for k, v in e["overhead_split"].items())
        console.print(f"Step time: forward {fmt.pct(e['forward_share'])}, outside the model "
                      f"{fmt.pct(e['overhead_share'])} ({split})")
        if "outside_step_share" in e:
            console.print(f"  {fmt.pct(e['outside_step_share'])} of wall time is outside "
                          "step() altogether")
    console.print(f"[bold]Bottleneck:[/] {ex.bottleneck}")
    if ex.levers:
        first, *rest = ex.levers
        console.print(f"[bold]Next lever:[/] {first.name}: {first.why}")
        for lever in rest:
            console.print(f"  then: {lever.name}: {lever.why}")
    for note in ex.notes:
        console.print(f"[dim]note: {note}[/]")
