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
from pathlib import Path

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
from tokenmill.roofline.hardware import ALIASES, CATALOG, bandwidth_basis
from tokenmill.roofline.inputs import UsageError, load_hardware, load_model, weight_bits
from tokenmill.roofline.moe_explain import expert_sharing_why, moe_note

KV_DTYPES = {"fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "int8": "int8",
             "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16",
             "float32": "fp32", "fp32": "fp32"}

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
    """One thing to try. `flags`: the `tokenmill serve` flags that pull it; where no flag
    does (a code change, or nothing tokenmill has on this hardware), `instead` says so."""

    name: str
    why: str
    flags: list[str] = field(default_factory=list)
    instead: str | None = None

    def action(self) -> str:
        return f"try: {' '.join(self.flags)}" if self.flags else f"no serving flag: {self.instead}"


def target_config(config: dict) -> dict | None:
    """What the run's server said it runs (`config.server_config`, from /server_info), or an
    offline run's engine arguments; None when the result does not say."""
    server = config.get("server_config")
    if isinstance(server, dict):
        return server
    if config.get("backend") == "offline" and isinstance(config.get("engine_args"), dict):
        return {"engine": "tokenmill", "enable_chunked_prefill": True,
                **config["engine_args"]}
    return None


@dataclass(frozen=True)
class _Run:
    """What the measured run was: model, weights, machine, decode batch and context."""

    arch: ModelArch
    bits: WeightBits
    report: RooflineReport
    batch: float
    context: int
    kv_bytes_per_element: float
    server: dict | None = None  # target_config(): what the run already has on
    output_len: int = 1
    join_tokens: float = 0.0  # uncached prompt tokens of a request joining the batch
    join_share: float = 0.0  # of the other slots, the share that took a next request
    whole_run: bool = False  # the step time is the run's (batch ÷ throughput): every prompt

    @property
    def machine(self) -> Machine:
        return self.report.machine

    def joins_per_step(self, batch: float) -> float:
        """Prompts prefilled in the steps a sequence decodes in, per step: while it decodes
        its `output_len` tokens, each of the other `batch - 1` slots takes its next request
        once (`join_share` of them: see _join_share). A step time taken from the whole
        run's throughput holds every request's prompt: `batch` of them every `output_len`
        steps."""
        if self.join_tokens < 1:
            return 0.0
        slots = batch if self.whole_run else self.join_share * max(0.0, batch - 1)
        return slots / self.output_len

    def decode_floor(self, bits: WeightBits, batch: float) -> StepFloor:
        """A decode step of `batch` sequences, with the prompts that join it prefilled."""
        floor = decode_step(self.arch, bits, self.machine, batch, self.context,
                            self.kv_bytes_per_element)
        joins = self.joins_per_step(batch)
        if not joins:
            return floor
        pre = prefill_step(self.arch, bits, self.machine, max(1, round(self.join_tokens)),
                           self.kv_bytes_per_element)
        return self.machine.floor(batch, floor.weight_bytes,
                                  floor.kv_bytes + joins * pre.kv_bytes,
                                  floor.flops + joins * pre.flops,
                                  floor.attention_linear_flops
                                  + joins * pre.attention_linear_flops)

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
            "peak_flops": r.machine.peak_flops, "compute_dtype": r.machine.compute_dtype,
            "attention_compute_dtype": r.machine.attention_dtype,
            "attention_peak_flops": r.machine.attention_peak_flops,
            "decode": self.decode, "prefill": self.prefill,
            "engine": self.engine, "bottleneck": self.bottleneck,
            "bandwidth_basis": bandwidth_basis(r.hardware),
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
    """What the run's weights were: the server's own quantization and dtype where the
    result records them (a tokenmill server on the embedded model says gguf-a16: its
    Q4_1 file, not the preset's bf16), else the client's --dtype, else the checkpoint's."""
    server = target_config(config) or {}
    served = server.get("model")
    if isinstance(served, str) and served.endswith(".gguf") and Path(served).is_file():
        model = load_model(served)  # the file the server said it runs (llama-server's /props)
    for source, key in ((server, "quantization"), (server, "dtype"), (config, "quantization"),
                        (config, "dtype")):
        value = source.get(key)
        if value and str(value).lower() not in ("none", "auto"):
            try:
                return weight_bits(model, str(value))
            except UsageError:
                continue  # e.g. an engine-specific label: fall back to the checkpoint's own
    return model.default_bits


def _model(config: dict, given: str | None):
    """The run's model: `--model` when given, else the name the client sent, else the file
    the server said it loaded (a server on a GGUF file serves it under its base name,
    which is no file here)."""
    if given:
        return load_model(given)
    named = str(config["model"])
    try:
        return load_model(named)
    except UsageError as e:
        server = target_config(config) or {}
        for key in ("model_path", "model"):
            loaded = server.get(key)
            if isinstance(loaded, str) and loaded != named and Path(loaded).is_file():
                return load_model(loaded)
        raise UsageError(f"{e}; pass --model with the file or preset the run served") from None


def explain(result: dict, args: argparse.Namespace) -> Explanation:
    config, summary = result["config"], result["summary"]
    engine = result.get("engine") if isinstance(result.get("engine"), dict) else None
    notes: list[str] = []
    model = _model(config, getattr(args, "model", None))
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
    server = target_config(config)
    if server is None:
        notes.append("the result does not record the server's configuration "
                     "(config.server_config): levers already in use may be listed")
    why = (server or {}).get("quantization_reason") or config.get("quantization_reason")
    if isinstance(why, str) and why:
        notes.append(f"weights: {why}")  # the path the server resolved, and why
    slots = _num(server, "max_num_seqs")
    if engine is None and slots and batch > slots:  # the rest waited in the server's queue
        notes.append(f"{batch:.3g} requests in flight, {slots:.0f} decoding at a time "
                     "(the server's max_num_seqs): the decode batch is the latter")
        batch = slots
    kv_dtype = KV_DTYPES.get(str((server or {}).get("kv_cache_dtype", "auto")).lower(),
                             "fp32" if bits.compute_dtype == "fp32" else "bf16")
    batches = sorted({1, 8, 32, 64, 128, 256, max(1, round(batch))})
    report = analyze(arch, bits, hardware, batches=batches, prompt_len=prompt_len,
                     output_len=output_len, context=context, kv_dtype=kv_dtype,
                     cost_per_hour=args.cost_per_hour)
    kv_bpe = report.kv_bytes_per_token / arch.kv_bytes_per_token(1)
    hit = _prefix_hit_rate(result, engine)
    step_ms = _num(summary, "tpot_ms", "mean") or _num(summary, "itl_ms", "mean")
    out_tps = _num(summary, "output_throughput_tok_s")
    whole_run = step_ms is None and bool(out_tps)
    if whole_run:
        step_ms = batch / out_tps * 1e3
        notes.append("no TPOT/ITL: decode step time taken as batch ÷ output throughput")
    run = _Run(arch, bits, report, batch, context, kv_bpe, server, output_len=output_len,
               join_tokens=(prompt or 0.0) * (1 - hit),
               join_share=_join_share(batch, _num(summary, "num_completed")
                                      or _num(config, "num_requests")),
               whole_run=whole_run)
    machine = report.machine

    decode = None
    floor = run.decode_floor(bits, batch)
    shared = run.joins_per_step(batch) * run.join_tokens
    if shared:
        whose = ("every request's prompt" if whole_run
                 else "the other sequences' next prompts")
        notes.append(f"each decode step also prefilled {shared:,.0f} prompt tokens on average "
                     f"({whose}, {run.join_tokens:,.0f} uncached tokens each, over "
                     f"{output_len:,} steps): counted in its floor")
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
            "shared_prefill_tokens_per_step": shared,
        }

    prefill = None
    uncached = max(1, round(prompt_len * (1 - hit)))  # the prefix cache served the rest
    pre = prefill_step(arch, bits, machine, uncached, kv_bpe)
    ttft_ms = _num(summary, "ttft_ms", "p50") or _num(summary, "ttft_ms", "mean")
    if ttft_ms and prompt is not None:
        ttft_s = ttft_ms / 1e3
        prefill = {
            "prompt_tokens": prompt_len, "uncached_tokens": uncached, "measured_ttft_ms": ttft_ms,
            "floor_ttft_ms": pre.time_s * 1e3, "bound": pre.bound, "flops": pre.flops,
            "arithmetic_intensity": pre.intensity, "achieved_flops_s": pre.flops / ttft_s,
            "mfu": pre.compute_time_s / ttft_s, "fraction_of_floor": pre.time_s / ttft_s,
        }
        notes.append("prefill MFU uses TTFT p50, which includes queueing and any decode steps "
                     "it shared: a lower bound on the kernel's own MFU")

    engine_view = _engine_view(engine, arch, bits, machine, context, prompt_len, kv_bpe)
    if arch.is_moe:
        notes.append(moe_note(arch, bits, batch, engine))
    if any(part and part.get("fraction_of_floor", 0) > 1.05
           for part in (decode, prefill, engine_view)):
        notes.append("a measured time beats its floor: the hardware figures are too low "
                     "(a contended CPU micro-benchmark?); pass --bandwidth / --flops")
    bottleneck, levers = _diagnose(run, decode, prefill, engine_view, summary, hw_name)
    return Explanation(str(args.result), hw_name, report, decode, prefill, engine_view,
                       bottleneck, levers, notes + report.notes + list(model.notes))


def _prompt_tokens(prefill: dict) -> str:
    """'128 tokens', or '1,088 tokens, 80 uncached' where the prefix cache served some."""
    total, uncached = prefill["prompt_tokens"], prefill.get("uncached_tokens", 0)
    tail = f", {uncached:,} uncached" if uncached and uncached < total else ""
    return f"{total:,} tokens{tail}"


def _prefix_hit_rate(result: dict, engine: dict | None) -> float:
    """The share of prompt tokens the prefix cache served: the server's metrics' rate, or
    an offline run's engine counts; 0 where the result says neither."""
    server = result.get("server") if isinstance(result.get("server"), dict) else None
    rate = _num(server, "prefix_cache_hit_rate")
    queries = _num(engine, "prefix_cache_queries")
    if rate is None and queries:
        rate = (_num(engine, "prefix_cache_hits") or 0.0) / queries
    return min(1.0, max(0.0, rate or 0.0))


def _join_share(batch: float, requests: float | None) -> float:
    """Of the `batch - 1` other slots, the share that takes a next request while a
    sequence decodes: all in a long run, fewer where fewer requests than that were left
    after the first batch, none where the result does not say how many requests ran."""
    if requests is None or batch <= 1:
        return 0.0
    return max(0.0, min(batch - 1, requests - batch)) / (batch - 1)


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


CODE_CHANGE = "it needs a change inside tokenmill itself"


def _on(server: dict | None, key: str) -> bool | None:
    """Whether the target runs with `key` on: True / False, None when it does not say."""
    if not server or server.get(key) is None:
        return None
    value = server[key]
    return value.lower() not in ("false", "0", "none", "off") if isinstance(value, str) \
        else bool(value)


def _diagnose(run: _Run, decode, prefill, engine, summary, hw_name) -> tuple[str, list[Lever]]:
    report, bits, batch = run.report, run.bits, run.batch
    levers: list[Lever | None] = []
    gpu = hw_name != "cpu"
    fuse = (Lever("CUDA graphs (capture the decode step; one launch instead of hundreds)", "",
                  instead="tokenmill does not capture CUDA graphs yet") if gpu
            else Lever("fewer, fused ops per step (torch.compile or fused kernels)", "",
                       instead=CODE_CHANGE))

    if engine and engine["overhead_share"] >= OVERHEAD_BOUND_SHARE:
        split = ", ".join(f"{k} {fmt.pct(v)}" for k, v in
                          sorted(engine["overhead_split"].items(), key=lambda kv: -kv[1]))
        bottleneck = (f"host overhead: {fmt.pct(engine['overhead_share'])} of step time is "
                      f"outside the model forward ({split})")
        worst = max(engine["overhead_split"].items(), key=lambda kv: kv[1])
        levers.append(Lever(HOST_FIXES.get(worst[0], f"cut {worst[0]} time"),
                            f"{worst[0]} alone is {fmt.pct(worst[1])} of step time, paid "
                            "once per step whatever the batch", instead=CODE_CHANGE))
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
            fuse.why = (f"{m - f:.3g} ms of every {m:.3g} ms step is neither moving bytes nor "
                        "doing math at full rate: per-op launch, Python and slow kernels")
            levers.append(fuse)
            levers.append(_bigger_batch(run, "the same per-step overhead serves more tokens"))
            levers.append(_quantize(run, decode))
        elif decode["bound"] == "memory":
            bottleneck = (f"decode is memory-bandwidth-bound: {use} at batch {batch:.3g} "
                          f"(TPOT {m:.3g} ms, floor {f:.3g} ms)")
            levers.append(_bigger_batch(run, "weights are read once per step for "
                                        "the whole batch"))
            levers.append(_quantize(run, decode))
            levers.append(_kv_quant(run, decode, gpu))
            if batch <= 4:
                levers.append(_speculate(run, decode))
        else:
            bottleneck = (f"decode is compute-bound at batch {batch:.3g}: {use} "
                          f"(TPOT {m:.3g} ms, floor {f:.3g} ms)")
            if bits.compute_dtype != "fp8" and "fp8" in report.hardware.peak_flops:
                levers.append(Lever("fp8 weights and activations", "doubles peak FLOP/s on "
                                    f"{report.hardware.name}",
                                    instead="tokenmill has no fp8 weight path yet"))
            smaller = max(1, round(batch / 2))
            levers.append(Lever("smaller batch for latency", "past the ridge point a bigger "
                                "batch adds TPOT without adding throughput",
                                flags=[f"--max-num-seqs {smaller}"]))
    elif prefill:
        t, f = prefill["measured_ttft_ms"], prefill["floor_ttft_ms"]
        bottleneck = (f"prefill: TTFT p50 {t:,.0f} ms against a {f:.3g} ms floor for "
                      f"{_prompt_tokens(prefill)} ({fmt.pct(prefill['mfu'])} MFU)")
        levers.extend(_prefill_levers(run, prefill, summary))
    else:
        bottleneck = "not enough measurements to name one (no TPOT, ITL, TTFT or throughput)"
    found = [lever for lever in levers if lever is not None]
    if prefill and not any(lever.name.startswith(("chunked", "smaller prefill", "prefix"))
                           for lever in found):
        found.extend(_prefill_levers(run, prefill, summary))
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
    why = (f"{reason}: floor throughput {fmt.tok_s(now)} → {fmt.tok_s(then)} tok/s; KV for "
           f"{run.report.max_batch:,} sequences of {run.context:,} tokens fits")
    if run.arch.is_moe:
        why = f"{why}; {expert_sharing_why(run.arch, run.bits, run.batch, target)}"
    allowed = _num(run.server, "max_num_seqs")
    if allowed is not None and allowed >= target:
        # the server already admits that many: the load, not the flag, kept the batch small
        return Lever(f"bigger batch ({run.batch:.3g} → {target})",
                     f"{why}; the server already admits {allowed:.0f} sequences "
                     f"(--max-num-seqs), so send more at once", flags=[],
                     instead=f"raise the client's concurrency (tokenmill bench --concurrency "
                     f"{target})")
    return Lever(f"bigger batch ({run.batch:.3g} → {target})", why,
                 flags=[f"--max-num-seqs {target}"])


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
                 f"{decode['floor_step_ms']:.3g} → {new.time_s * 1e3:.3g} ms",
                 flags=[f"--quantization {target}"])


def _kv_quant(run: _Run, decode, gpu: bool) -> Lever | None:
    share = decode["kv_bytes_per_step"] / decode["bytes_per_step"]
    if share < 0.5 or run.kv_bytes_per_element <= 1.0:  # already 8-bit
        return None
    # the CPU kernel reads int8 natively; on a GPU fp8 is the format the hardware has
    dtype = "fp8" if gpu else "int8"
    return Lever(f"{dtype} KV cache", f"KV reads are {fmt.pct(share)} of step bytes; "
                 f"{dtype} halves them (and the same --kv-cache-memory holds 2× the tokens)",
                 flags=[f"--kv-cache-dtype {dtype}"])


def _speculate(run: _Run, decode) -> Lever | None:
    if _on(run.server, "speculative"):
        return None
    return Lever("speculative decoding", f"at batch {run.batch:.3g} a step does "
                 f"{decode['arithmetic_intensity']:.3g} FLOP/byte against a ridge of "
                 f"{run.report.machine.ridge_intensity:,.0f}: verifying 4 draft tokens per "
                 "step costs about the same bytes",
                 flags=["--speculative ngram --num-speculative-tokens 4"])


def _prefill_levers(run: _Run, prefill, summary) -> list[Lever]:
    levers = []
    itl50, itl99 = _num(summary, "itl_ms", "p50"), _num(summary, "itl_ms", "p99")
    if itl50 and itl99 and itl99 > 3 * itl50:
        stall = (f"ITL p99 {itl99:.3g} ms is {itl99 / itl50:.1f}× p50 {itl50:.3g} ms: "
                 "prompt chunks stall running decodes")
        budget = _num(run.server, "max_num_batched_tokens")
        chunked = _on(run.server, "enable_chunked_prefill")
        if chunked is False:  # a peer with it off; tokenmill always chunks
            levers.append(Lever("chunked prefill", f"{stall}: whole prompts run in one step; "
                                "tokenmill always chunks prompts at --max-num-batched-tokens",
                                flags=["--max-num-batched-tokens 512"]))
        else:
            state = (f"chunked prefill is on, {budget:.0f} tokens a step" if chunked and budget
                     else "chunked prefill is on" if chunked
                     else "tokenmill always chunks prompts")
            target = max(64, round(budget / 2)) if budget else 512
            levers.append(Lever(f"smaller prefill chunks ({state})",
                                f"{stall}; a lower --max-num-batched-tokens cuts ITL p99 at "
                                "some cost in TTFT",
                                flags=[f"--max-num-batched-tokens {target}"]))
        if not run.server or not run.server.get("kv_transfer"):
            levers.append(Lever(
                "prefill/decode disaggregation",
                f"{stall}; prompts prefilled on an instance of their own leave the decode "
                "instance's ITL flat, at the price of a KV transfer per request and the "
                "cores split between the two roles: the first flag on a prefill instance, "
                "the second on a decode one, both behind vllm-router "
                "--vllm-pd-disaggregation (docs/scale-out.md)",
                flags=["--kv-transfer-config '{\"kv_role\": \"kv_producer\"}'",
                       "--kv-transfer-config '{\"kv_role\": \"kv_consumer\"}'"]))
    e2e = _num(summary, "e2e_ms", "mean")
    ttft = prefill["measured_ttft_ms"]
    if e2e and ttft / e2e > 0.2 and not _on(run.server, "enable_prefix_caching"):
        levers.append(Lever("prefix caching (if prompts share a prefix)",
                            f"TTFT is {fmt.pct(ttft / e2e)} of end-to-end latency; a cached "
                            f"prefix skips its share of the {prefill['prompt_tokens']:,}-token "
                            "prefill", flags=["--enable-prefix-caching"]))
    if prefill["mfu"] < 0.3 and prefill["bound"] == "compute":
        levers.append(Lever("faster prefill kernels", f"prefill reaches {fmt.pct(prefill['mfu'])}"
                            f" MFU: {run.machine.compute_dtype} matmuls over the whole prompt, "
                            "one attention call", instead=CODE_CHANGE))
    return levers


def print_explanation(ex: Explanation) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    r, m = ex.roofline, ex.roofline.machine
    console.print(f"[bold]{ex.source}[/]: {r.model} ({r.dtype} weights) on "
                  f"{r.hardware.description}")
    console.print(f"  floor from bandwidth {fmt.si(m.bandwidth_bytes_s, 'B/s')} "
                  f"({bandwidth_basis(r.hardware)}), peak {m.compute_dtype} "
                  f"{fmt.si(m.peak_flops, 'FLOP/s')}" + (
                      "" if m.attention_peak_flops is None else
                      f" (the attention's linears at {m.attention_dtype}: "
                      f"{fmt.si(m.attention_peak_flops, 'FLOP/s')})"))
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
        table.add_row(f"prefill (TTFT p50), {_prompt_tokens(p)}",
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
        # one unwrapped line per lever, so that it ends with the flag to paste
        console.print(f"[bold]Next lever:[/] {first.name}: {first.why}; {first.action()}",
                      soft_wrap=True)
        for lever in rest:
            console.print(f"  then: {lever.name}: {lever.why}; {lever.action()}",
                          soft_wrap=True)
    for note in ex.notes:
        console.print(f"[dim]note: {note}[/]")
