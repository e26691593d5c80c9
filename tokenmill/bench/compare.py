"""`tokenmill bench --compare a.json b.json ...`: runs side by side, each against the
first (the "change one thing, measure again" step), in the console and in HTML.

diff % = 100 × (run − first) / first; a difference is *better* when it goes the
metric's good way (throughput up, latency down) and |diff| > 1%.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

# (label, path in the result, the good direction: "higher", "lower" or None)
COMPARE_ROWS: tuple[tuple[str, str, str | None], ...] = (
    ("requests completed", "summary.num_completed", None),
    ("requests failed", "summary.num_failed", "lower"),
    ("output tok/s", "summary.output_throughput_tok_s", "higher"),
    ("total tok/s", "summary.total_throughput_tok_s", "higher"),
    ("requests/s", "summary.request_throughput", "higher"),
    ("TTFT p50 (ms)", "summary.ttft_ms.p50", "lower"),
    ("TTFT p99 (ms)", "summary.ttft_ms.p99", "lower"),
    ("TPOT p50 (ms)", "summary.tpot_ms.p50", "lower"),
    ("TPOT p99 (ms)", "summary.tpot_ms.p99", "lower"),
    ("ITL p50 (ms)", "summary.itl_ms.p50", "lower"),
    ("ITL p99 (ms)", "summary.itl_ms.p99", "lower"),
    ("E2E p50 (ms)", "summary.e2e_ms.p50", "lower"),
    ("E2E p99 (ms)", "summary.e2e_ms.p99", "lower"),
    ("goodput (req/s)", "summary.goodput_req_s", "higher"),
    ("SLO attainment (%)", "summary.slo_attainment", "higher"),
    ("$ per 1M output tokens", "summary.cost_per_1m_output_tokens", "lower"),
    ("server TTFT mean (ms)", "server.latency.ttft.mean_ms", "lower"),
    ("server ITL mean (ms)", "server.latency.itl.mean_ms", "lower"),
    ("server E2E mean (ms)", "server.latency.e2e.mean_ms", "lower"),
    ("client CPU share (0..1)", "client.cpu_share", "lower"),
)
SAME_PCT = 1.0


def load_results(paths: list[str]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        if not Path(p).exists():
            raise FileNotFoundError(f"--compare: {p} does not exist")
        result = json.loads(Path(p).read_text())
        if "summary" not in result or "config" not in result:
            raise ValueError(f"--compare: {p} is not a tokenmill bench result (no summary)")
        out.append(result)
    return out


def lookup(d: dict[str, Any], path: str) -> float | None:
    for part in path.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def compare_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per metric any run has: values, diff % against the first run, and
    whether each difference is better, worse or the same."""
    rows = []
    for label, path, good in COMPARE_ROWS:
        values = [lookup(r, path) for r in results]
        if all(v is None for v in values):
            continue
        base = values[0]
        diffs, verdicts = [], []
        for v in values:
            diff = 100.0 * (v - base) / base if v is not None and base else None
            diffs.append(diff)
            if diff is None or good is None or abs(diff) <= SAME_PCT:
                verdicts.append("same")
            else:
                verdicts.append("better" if (diff > 0) == (good == "higher") else "worse")
        rows.append({"label": label, "key": path, "values": values, "diff_pct": diffs,
                     "verdict": verdicts})
    return rows


def config_differences(results: list[dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    """The config keys whose values differ between the runs: what was changed."""
    keys = sorted({k for r in results for k in r["config"]})
    diffs = []
    for k in keys:
        vals = [r["config"].get(k) for r in results]
        if any(json.dumps(v, sort_keys=True, default=str) !=
               json.dumps(vals[0], sort_keys=True, default=str) for v in vals):
            diffs.append((k, vals))
    return diffs


def fmt_value(v: float | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) or float(v).is_integer() and abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3g}"


def print_compare(console: Console, names: list[str], results: list[dict[str, Any]]) -> None:
    t = Table(title=f"comparison against {names[0]} (diff = (run - first) / first)",
              title_justify="left")
    t.add_column("metric", style="bold")
    for i, n in enumerate(names):
        t.add_column(n, justify="right")
        if i:
            t.add_column("diff", justify="right")
    colour = {"better": "green", "worse": "red", "same": "default"}
    for row in compare_rows(results):
        cells = []
        for i, v in enumerate(row["values"]):
            cells.append(fmt_value(v))
            if i:
                d = row["diff_pct"][i]
                cells.append("-" if d is None else
                             f"[{colour[row['verdict'][i]]}]{d:+.1f}%[/]")
        t.add_row(row["label"], *cells)
    console.print(t)
    for key, vals in config_differences(results):
        console.print(f"changed: {key}: " + " | ".join(
            f"{n}: {json.dumps(v, default=str)}" for n, v in zip(names, vals)))
