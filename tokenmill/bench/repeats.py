"""`--repeats N`: one configuration run N times, each headline metric as a mean with its
95% interval; with a second server (`--versus URL`), the runs alternate A B B A A B B A …
(so neither server always runs first, or last, in a drifting machine) and the result
also holds B/A per metric with its interval."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenmill.bench.confidence import mean_ci95, ratio_ci95

# (JSON name, path into a run's summary): what every repeat reports
HEADLINE = {
    "output_throughput_tok_s": ("output_throughput_tok_s",),
    "total_throughput_tok_s": ("total_throughput_tok_s",),
    "request_throughput": ("request_throughput",),
    "goodput_req_s": ("goodput_req_s",),
    "ttft_ms_p50": ("ttft_ms", "p50"),
    "ttft_ms_p99": ("ttft_ms", "p99"),
    "tpot_ms_p50": ("tpot_ms", "p50"),
    "tpot_ms_p99": ("tpot_ms", "p99"),
    "itl_ms_p50": ("itl_ms", "p50"),
    "e2e_ms_p50": ("e2e_ms", "p50"),
}


def metric_of(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    v: Any = summary
    for key in path:
        if not isinstance(v, dict):
            return None
        v = v.get(key)
    return float(v) if isinstance(v, int | float) else None


def ci_section(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each headline metric over `runs`: mean, ci95, std, n, values."""
    return {name: mean_ci95([metric_of(r["summary"], path) for r in runs])
            for name, path in HEADLINE.items()}


def abba_order(repeats: int) -> list[int]:
    """Which server runs at each step: 0 1 1 0 0 1 1 0 … for `repeats` runs of each."""
    order: list[int] = []
    for k in range(repeats):
        order += [0, 1] if k % 2 == 0 else [1, 0]
    return order


def run_repeats(run: Callable[[int, int], dict[str, Any]], repeats: int,
                num_servers: int = 1) -> dict[str, Any]:
    """`run(server, pair_index)` → one result dict. Pair k runs on the same prompts on
    every server (run index k), so a ratio compares like with like."""
    if repeats < 2:
        raise ValueError("--repeats needs at least 2 runs for an interval")
    per_server: list[list[dict[str, Any]]] = [[] for _ in range(num_servers)]
    order = abba_order(repeats) if num_servers == 2 else [0] * repeats
    for server in order:
        per_server[server].append(run(server, len(per_server[server])))
    out: dict[str, Any] = {"repeats": {"n": repeats, "order": "ABBA" if num_servers == 2
                                       else "sequential",
                                       "metrics": ci_section(per_server[0])}}
    if num_servers == 2:
        b_metrics = ci_section(per_server[1])
        ratios = {name: ratio_ci95([metric_of(r["summary"], path) for r in per_server[0]],
                                   [metric_of(r["summary"], path) for r in per_server[1]])
                  for name, path in HEADLINE.items()}
        out["repeats"]["versus"] = {"metrics": b_metrics, "ratio_b_over_a": ratios}
    out["runs_by_server"] = per_server
    return out


def print_repeats(console, result: dict[str, Any], names: tuple[str, str] = ("A", "B")) -> None:
    """Mean [95% interval] per metric; with a second server, its column and B/A."""
    from rich import box
    from rich.table import Table

    from tokenmill.bench.confidence import fmt_ci

    rep = result["repeats"]
    versus = rep.get("versus")
    t = Table(title=f"{rep['n']} repeats ({rep['order']}): mean [95% interval]",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("metric")
    t.add_column(names[0] if versus else "value", justify="right")
    if versus:
        t.add_column(names[1], justify="right")
        t.add_column(f"{names[1]}/{names[0]}", justify="right")
    for name in HEADLINE:
        row = [name, fmt_ci(rep["metrics"][name])]
        if versus:
            row += [fmt_ci(versus["metrics"][name]), fmt_ci(versus["ratio_b_over_a"][name])]
        t.add_row(*row)
    console.print(t)
