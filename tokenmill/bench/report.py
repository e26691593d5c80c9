"""What the user sees in the console: a rich progress bar and tables; and the result JSON.
The plots are in plots.py, the HTML report in html_report.py."""

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
             f"{cfg.get('endpoint')} · {load_label(cfg)}")
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
    if s.get("power"):
        from tokenmill.bench.power import power_label

        rows.append(("energy", power_label(s["power"])))
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
    if "server" in result:
        print_server(console, result["server"])
    if "client" in result:
        print_client(console, result["client"])
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


def print_server(console: Console, server: dict[str, Any]) -> None:
    """The server's own numbers beside the client's (the reconciliation)."""
    if not server.get("available"):
        console.print(f"server metrics: none ({server.get('reason')})")
        return
    t = Table(title=(f"client vs server ({server['scheme']} {server['source']}; diff = "
                     f"(client - server) / server)"), title_justify="left")
    for col in ("", "client", "server", "diff"):
        t.add_column(col, justify="right" if col else "left")
    for row in server.get("reconciliation", []):
        diff = "-" if row["diff_pct"] is None else f"{row['diff_pct']:+.1f}%"
        fmt = "{:,.2f}" if row["what"].endswith("(ms)") else "{:,.0f}"
        t.add_row(row["what"], _num(row["client"], fmt), _num(row["server"], fmt),
                  f"[red]{diff}[/]" if row["warn"] else diff)
    console.print(t)
    extra = []
    for key, label in (("queue", "queue time"),):
        st = server.get("latency", {}).get(key)
        if st and st["mean_ms"] is not None:
            extra.append(f"{label} mean {_ms(st['mean_ms'])} ms, p99 {_ms(st.get('p99_ms'))} ms")
    g = server.get("gauges", {})
    for key, label, scale in (("running", "running", 1), ("waiting", "waiting", 1),
                              ("kv_cache_usage", "KV cache %", 100)):
        if key in g:
            extra.append(f"{label} mean {scale * g[key]['mean']:.1f} / max "
                         f"{scale * g[key]['max']:.1f}")
    if server.get("prefix_cache_hit_rate") is not None:
        extra.append(f"prefix-cache hit rate {100 * server['prefix_cache_hit_rate']:.1f}%")
    if extra:
        console.print("server: " + "; ".join(extra))


def print_client(console: Console, c: dict[str, Any]) -> None:
    lag = c["loop_lag_ms"]
    lag_text = ("-" if lag["max"] is None else
                f"mean {lag['mean']:.2f} / p99 {lag['p99']:.2f} / max {lag['max']:.1f} ms")
    console.print(f"client: {c['cpu_seconds']:.2f} CPU s in {c['wall_s']:.2f} s = "
                  f"{100 * c['cpu_share']:.1f}% of {c['num_cpus']} CPUs "
                  f"({c['workers']} generator process{'es' if c['workers'] > 1 else ''}); "
                  f"event-loop lag {lag_text}"
                  + ("; same host as the server" if c["same_host"] else ""))


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


def load_label(cfg: dict[str, Any]) -> str:
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
