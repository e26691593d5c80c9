"""What the user sees: a rich progress bar and tables, the result JSON, and PNG plots.

matplotlib is imported only when plots are asked for.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tokenmill.bench.client import RequestRecord

LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


# ---- progress --------------------------------------------------------------------------


class ProgressFactory:
    """`with factory(label, total, duration_s) as on_done:` shows a bar until the run ends."""

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self.console = console
        self.enabled = enabled

    @contextlib.contextmanager
    def __call__(self, label: str, total: int | None, duration_s: float | None) -> Iterator:
        if not self.enabled:
            yield lambda r: None
            return
        failed = 0
        columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[failed]}"), TimeElapsedColumn()]
        with Progress(*columns, console=self.console, transient=True,
                      refresh_per_second=4) as progress:
            task = progress.add_task(label, total=total, failed="")

            def on_done(record: RequestRecord) -> None:
                nonlocal failed
                failed += not record.ok
                progress.update(task, advance=1,
                                failed=f"[red]{failed} failed" if failed else "")

            yield on_done


# ---- tables ----------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def _num(v: float | None, fmt: str = "{:,.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def print_summary(console: Console, result: dict[str, Any]) -> None:
    cfg, s = result["config"], result["summary"]
    title = (f"tokenmill bench · {cfg.get('model')} · {cfg.get('backend')} "
             f"{cfg.get('endpoint')} · {_load_label(cfg)}")
    head = Table(title=title, show_header=False, title_justify="left", box=None)
    head.add_column(style="bold")
    head.add_column(justify="right")
    failures = ", ".join(f"{k} {v}" for k, v in s["failures"].items())
    rows = [
        ("requests completed / failed",
         f"{s['num_completed']} / {s['num_failed']}" + (f" ({failures})" if failures else "")),
        ("duration", f"{s['duration_s']:.2f} s"),
        ("request throughput", f"{s['request_throughput']:.2f} req/s"),
        ("output throughput", (f"{s['output_throughput_tok_s']:,.1f} tok/s (peak "
                               f"{s['peak_output_throughput_tok_s']:,.0f} tok/s in 1 s)")),
        ("total throughput", f"{s['total_throughput_tok_s']:,.1f} tok/s"),
        ("mean in-flight requests", f"{s['mean_in_flight']:.2f}"),
        ("mean input / output tokens",
         f"{s['mean_input_tokens']:.1f} / {s['mean_output_tokens']:.1f}"),
        ("tokens per chunk", _chunk_label(s["chunk_tokens"])),
    ]
    check = s["token_count_check"]
    if check["output_compared"]:
        rows.append(("output tokens server / client",
                     (f"{check['output_server_total']} / {check['output_client_total']}"
                      f" ({check['output_mismatched']} requests differ)")))
    if s.get("slo_attainment") is not None:
        slo = ", ".join(f"{k} ≤ {v:g}" for k, v in (s.get("slo") or {}).items() if v is not None)
        rows.append(("goodput", (f"{s['goodput_req_s']:.2f} req/s, attainment "
                                 f"{s['slo_attainment']:.1f}% ({slo})")))
    if s.get("cost_per_1m_output_tokens") is not None:
        rows.append(("cost per 1M output / total tokens",
                     (f"${s['cost_per_1m_output_tokens']:,.3f} / "
                      f"${s['cost_per_1m_total_tokens']:,.3f}")))
    rows.append(("load generator lag max / mean",
                 f"{s['generator_lag_s'] * 1e3:.1f} / {s['generator_lag_mean_s'] * 1e3:.2f} ms"))
    for k, v in rows:
        head.add_row(k, v)
    console.print(head)

    lat = Table(title="latency (ms)", title_justify="left")
    lat.add_column("metric", style="bold")
    for col in ("mean", "std", "p50", "p90", "p95", "p99", "max"):
        lat.add_column(col, justify="right")
    for name, key in LATENCIES:
        st = s[key]
        lat.add_row(name, *(_ms(st[c]) for c in ("mean", "std", "p50", "p90", "p95", "p99",
                                                  "max")))
    console.print(lat)
    if "engine" in result:
        print_engine(console, result["engine"])
    for note in result.get("notes", []):
        console.print(f"[yellow]note:[/] {note}")


def print_engine(console: Console, e: dict[str, Any]) -> None:
    """Where the engine's wall time went, phase by phase."""
    wall = e["wall_time_s"] or 1.0
    t = Table(title=(f"engine (offline): {e['num_steps']} steps, {e['num_prefill_tokens']} "
                     f"prefill + {e['num_decode_tokens']} decode tokens, mean decode batch "
                     f"{e['mean_decode_batch']:.1f}"), title_justify="left")
    t.add_column("phase", style="bold")
    t.add_column("time", justify="right")
    t.add_column("share of wall", justify="right")
    t.add_column("per step", justify="right")
    steps = max(e["num_steps"], 1)
    for phase, v in e["time_s"].items():
        t.add_row(phase, f"{v:.3f} s", f"{100 * v / wall:.1f}%", f"{1e3 * v / steps:.2f} ms")
    other = wall - sum(e["time_s"].values())
    t.add_row("outside step()", f"{other:.3f} s", f"{100 * other / wall:.1f}%", "")
    t.add_row("wall", f"{e['wall_time_s']:.3f} s", "100%", f"{1e3 * wall / steps:.2f} ms")
    console.print(t)


def print_runs(console: Console, result: dict[str, Any]) -> None:
    """One row per run of a sweep or search."""
    t = Table(title="runs (latencies in ms; bold: the run in `summary`)", title_justify="left",
              box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("load", "ok/err", "req/s", "tok/s", "TTFT p50", "p99", "TPOT p50", "p99",
                "good/s", "SLO %"):
        t.add_column(col, justify="right")
    for i, run in enumerate(result["runs"]):
        c, s = run["config"], run["summary"]
        style = "bold" if i == result.get("summary_run_index") else None
        load = (f"c={c['concurrency']}" if c["concurrency"] else "") + (
            f" {c['request_rate']:g}/s" if c["request_rate"] else "")
        t.add_row(load.strip() or "all", f"{s['num_completed']}/{s['num_failed']}",
                  f"{s['request_throughput']:.2f}", f"{s['output_throughput_tok_s']:,.1f}",
                  _ms(s["ttft_ms"]["p50"]), _ms(s["ttft_ms"]["p99"]), _ms(s["tpot_ms"]["p50"]),
                  _ms(s["tpot_ms"]["p99"]), _num(s["goodput_req_s"]),
                  _num(s["slo_attainment"], "{:.1f}"), style=style)
    console.print(t)
    if "search" in result:
        sr = result["search"]
        best = sr["max_rate_req_s"]
        console.print(f"[bold]max request rate with ≥ {sr['target_attainment']:g}% SLO "
                      f"attainment:[/] " + (f"{best:.3g} req/s" if best else
                                            "none of the probed rates met the SLOs"))


def _load_label(cfg: dict[str, Any]) -> str:
    parts = []
    if cfg.get("concurrency"):
        parts.append(f"concurrency {cfg['concurrency']}")
    if cfg.get("request_rate"):
        parts.append(f"{cfg['request_rate']:g} req/s")
    return ", ".join(parts) or "all at once"


def _chunk_label(chunks: dict[str, Any]) -> str:
    hist = chunks["histogram"]
    if not hist:
        return "-"
    total = sum(hist.values())
    top = sorted(hist.items(), key=lambda kv: -kv[1])[:4]
    return f"mean {chunks['mean']:.2f} (" + ", ".join(
        f"{k} tok: {100 * v / total:.1f}%" for k, v in top) + ")"


# ---- JSON ------------------------------------------------------------------------------


def write_json(result: dict[str, Any], path: str) -> None:
    def clean(o: Any) -> Any:
        if isinstance(o, float) and not math.isfinite(o):
            return None
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, list):
            return [clean(v) for v in o]
        return o

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(clean(result), indent=1))


# ---- plots -----------------------------------------------------------------------------


def write_plots(result: dict[str, Any], out_dir: str) -> list[str]:
    """PNG files: TTFT and TPOT CDFs, a per-request timeline, and for multi-run results
    the throughput-latency frontier and goodput vs rate. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = result.get("runs") or [result]
    slo = result["summary"].get("slo") or {}
    written = []
    for key, title, slo_key, fname in (("ttft_s", "Time to first token", "ttft_ms",
                                        "ttft_cdf.png"),
                                       ("tpot_s", "Time per output token", "tpot_ms",
                                        "tpot_cdf.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _cdf(ax, runs, key, slo.get(slo_key))
        ax.set_title(f"{title} — CDF ({_model_label(result)})")
        written.append(_save(fig, out / fname))
    fig = _timeline(plt, result)
    written.append(_save(fig, out / "timeline.png"))
    if len(runs) > 1:
        written.append(_save(_frontier(plt, runs), out / "frontier.png"))
        written.append(_save(_goodput(plt, result), out / "goodput.png"))
    plt.close("all")
    return written


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def _model_label(result: dict[str, Any]) -> str:
    c = result["config"]
    return f"{c.get('model')}, {c.get('backend')}"


def _run_label(cfg: dict[str, Any]) -> str:
    return _load_label(cfg)


def _cdf(ax, runs: list[dict[str, Any]], key: str, slo_ms: float | None) -> None:
    import numpy as np

    plotted = False
    for run in runs:
        vals = np.sort([r[key] * 1e3 for r in run["requests"] if r[key] is not None
                        and r["error_kind"] is None])
        if not vals.size:
            continue
        n_all = len(run["requests"])  # failures keep the curve below 1: they never finish
        y = np.arange(1, vals.size + 1) / n_all
        line, = ax.step(np.concatenate([[0.0, vals[0]], vals]),
                        np.concatenate([[0.0, 0.0], y]), where="post",
                        label=_run_label(run["config"]))
        if len(runs) == 1:
            for p, ls in ((50, "--"), (99, ":")):
                v = float(np.percentile(vals, p))
                ax.axvline(v, color=line.get_color(), ls=ls, lw=1)
                ax.annotate(f"p{p} {v:,.1f} ms", (v, 0.02 if p == 50 else 0.12),
                            xytext=(4, 0), textcoords="offset points", fontsize=8)
        plotted = True
    if slo_ms:
        ax.axvline(slo_ms, color="red", lw=1.5, label=f"SLO {slo_ms:g} ms")
    ax.set_xlabel("milliseconds")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    if plotted or slo_ms:
        ax.legend(fontsize=8, loc="lower right")


def _timeline(plt, result: dict[str, Any]):
    import numpy as np

    reqs = sorted(result["requests"], key=lambda r: r["send_time_s"])
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1.3]})
    for i, r in enumerate(reqs):
        send = r["send_time_s"]
        if r["planned_time_s"] < send - 1e-3:
            ax.hlines(i, r["planned_time_s"], send, color="0.75", lw=1)
        if r["error_kind"] is not None:
            ax.hlines(i, send, r["end_time_s"], color="tab:red", lw=2)
            ax.plot([r["end_time_s"]], [i], "x", color="tab:red", ms=4)
            continue
        first = send + r["ttft_s"]
        ax.hlines(i, send, first, color="tab:orange", lw=2)
        ax.hlines(i, first, send + r["e2e_s"], color="tab:blue", lw=2)
    ax.set_ylabel("request (by send time)")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="tab:orange", lw=2, label="waiting for first token"),
               Line2D([], [], color="tab:blue", lw=2, label="streaming output"),
               Line2D([], [], color="tab:red", lw=2, label="failed"),
               Line2D([], [], color="0.75", lw=1, label="queued in the client (slot busy)")]
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    ax.set_title(f"Per-request timeline ({_model_label(result)}, "
                 f"{_load_label(result['config'])})")
    ax.grid(alpha=0.3, axis="x")
    # lower panel: output tokens/s in time buckets (1 s, finer for short runs), in flight
    end = max((r["end_time_s"] for r in reqs), default=0.0)
    width = 1.0 if end >= 20 else max(end / 20, 1e-3)
    toks = np.zeros(max(math.ceil(end / width), 1))
    for r in reqs:
        for t, k in zip(r["chunk_times_s"], r["chunk_tokens"] or [1] * len(r["chunk_times_s"])):
            toks[min(int(t / width), len(toks) - 1)] += k
    ax2.bar((np.arange(len(toks)) + 0.5) * width, toks / width, width=0.9 * width,
            color="tab:blue", alpha=0.5, label=f"output tok/s ({width:.3g} s buckets)")
    ax2.set_ylabel("output tok/s")
    ax2.set_xlabel("seconds since start")
    events = sorted([(r["send_time_s"], 1) for r in reqs] + [(r["end_time_s"], -1) for r in reqs])
    times = [0.0] + [t for t, _ in events]
    in_flight = np.concatenate([[0], np.cumsum([d for _, d in events])])
    ax3 = ax2.twinx()
    ax3.step(times, in_flight, where="post", color="tab:green", lw=1.5,
             label="requests in flight")
    ax3.set_ylim(bottom=0)
    ax3.set_ylabel("in flight")
    h1, l1 = ax2.get_legend_handles_labels()
    h2, l2 = ax3.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper right")
    return fig


def _frontier(plt, runs: list[dict[str, Any]]):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    x = [r["summary"]["output_throughput_tok_s"] for r in runs]
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for p, marker in (("p50", "o-"), ("p99", "s--")):
            y = [r["summary"][key][p] for r in runs]
            ax.plot(x, y, marker, label=f"{name} {p}")
        for xi, r in zip(x, runs):
            ax.annotate(_run_label(r["config"]), (xi, r["summary"][key]["p99"] or 0),
                        xytext=(3, 4), textcoords="offset points", fontsize=7)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} vs throughput")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Latency–throughput frontier (each point one run)")
    return fig


def _goodput(plt, result: dict[str, Any]):
    runs = sorted(result["runs"], key=lambda r: _offered_rate(r))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [_offered_rate(r) for r in runs]
    offered = all(r["config"]["request_rate"] for r in runs)
    if offered:
        ax.plot(x, x, color="0.7", ls=":", label="offered = served")
    served = [r["summary"]["request_throughput"] for r in runs]
    ax.plot(x, served, "o-", label="throughput (completed req/s)")
    for xi, yi, r in zip(x, served, runs):
        ax.annotate(_run_label(r["config"]), (xi, yi), xytext=(3, 5),
                    textcoords="offset points", fontsize=7)
    has_slo = runs[0]["summary"].get("goodput_req_s") is not None
    if has_slo:
        ax.plot(x, [r["summary"]["goodput_req_s"] for r in runs], "s-", color="tab:green",
                label="goodput (req/s meeting every SLO)")
        ax2 = ax.twinx()
        ax2.plot(x, [r["summary"]["slo_attainment"] for r in runs], "^--", color="tab:purple",
                 alpha=0.6, label="SLO attainment %")
        ax2.set_ylim(0, 105)
        ax2.set_ylabel("SLO attainment (%)")
        target = (result.get("search") or {}).get("target_attainment")
        if target:
            ax2.axhline(target, color="tab:purple", lw=0.8, ls=":")
        ax2.legend(fontsize=8, loc="lower right")
    ax.set_xlabel("offered request rate (req/s)" if offered
                  else "achieved request rate (req/s)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("requests/s")
    ax.set_title("Goodput vs request rate" if has_slo else
                 "Throughput vs request rate (no --slo: no goodput)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return fig


def _offered_rate(run: dict[str, Any]) -> float:
    rate = run["config"].get("request_rate")
    return rate if rate else run["summary"]["request_throughput"]
