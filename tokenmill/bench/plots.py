"""The plots, as matplotlib figures: the TTFT and TPOT CDFs, the per-request timeline,
and for sweeps the latency-throughput frontier and goodput vs rate. `write_plots` saves
them as PNG files; the HTML report embeds the same figures.

matplotlib is imported only when a plot is asked for.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tokenmill.bench.report import load_label as _load_label


def write_plots(result: dict[str, Any], out_dir: str) -> list[str]:
    """PNG files: TTFT and TPOT CDFs, a per-request timeline, and for multi-run results
    the throughput-latency frontier and goodput vs rate. Returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [_save(fig, out / f"{name}.png") for name, _, fig in figures(result)]
    pyplot().close("all")
    return written


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figures(result: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(file stem, caption, figure) for every plot of `result`; the caller closes them."""
    plt = pyplot()
    runs = result.get("runs") or [result]
    slo = result["summary"].get("slo") or {}
    out = []
    for key, title, slo_key, name in (("ttft_s", "Time to first token", "ttft_ms",
                                       "ttft_cdf"),
                                      ("tpot_s", "Time per output token", "tpot_ms",
                                       "tpot_cdf")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _cdf(ax, runs, key, slo.get(slo_key))
        ax.set_title(f"{title} — CDF ({_model_label(result)})")
        out.append((name, f"{title}: fraction of requests at or below each latency", fig))
    out.append(("timeline", "Per-request timeline, output tok/s and requests in flight",
                _timeline(plt, result)))
    if len(runs) > 1:
        out.append(("frontier", "Latency vs output throughput, one point per run",
                    _frontier(plt, runs)))
        out.append(("goodput", "Throughput, goodput and SLO attainment vs request rate",
                    _goodput(plt, result)))
    if result.get("pareto"):
        from tokenmill.bench.pareto import pareto_figure

        caption = ("Output tok/s per user vs per device: the Pareto front, its knee "
                   "(circled) and the SLO line")
        out.append(("pareto", caption, pareto_figure(plt, [result], ["sweep"])))
    gauges = (result.get("server") or {}).get("gauges") or {}
    if gauges:
        out.append(("server", "The server's own gauges during the run (scraped /metrics)",
                    _server_gauges(plt, gauges)))
    return out


def compare_figures(results: list[dict[str, Any]],
                    names: list[str]) -> list[tuple[str, str, Any]]:
    """TTFT and TPOT CDFs of several results on shared axes, labelled by `names`."""
    plt = pyplot()
    out = []
    for key, title, name in (("ttft_s", "Time to first token", "ttft_cdf"),
                             ("tpot_s", "Time per output token", "tpot_cdf")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        _cdf(ax, results, key, None, labels=names)
        ax.set_title(f"{title} — CDF, one curve per run")
        out.append((name, f"{title} of every run", fig))
    if len(results) > 1 and all(r.get("pareto") for r in results):  # two sweeps: one plot
        from tokenmill.bench.pareto import pareto_figure

        out.append(("pareto", "Pareto fronts overlaid: output tok/s per user vs per device",
                    pareto_figure(plt, results, names)))
    return out


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def _model_label(result: dict[str, Any]) -> str:
    c = result["config"]
    return f"{c.get('model')}, {c.get('backend')}"


def _run_label(cfg: dict[str, Any]) -> str:
    return _load_label(cfg)


def _cdf(ax, runs: list[dict[str, Any]], key: str, slo_ms: float | None,
         labels: list[str] | None = None) -> None:
    import numpy as np

    plotted = False
    for i, run in enumerate(runs):
        vals = np.sort([r[key] * 1e3 for r in run["requests"] if r[key] is not None
                        and r["error_kind"] is None])
        if not vals.size:
            continue
        n_all = len(run["requests"])  # failures keep the curve below 1: they never finish
        y = np.arange(1, vals.size + 1) / n_all
        line, = ax.step(np.concatenate([[0.0, vals[0]], vals]),
                        np.concatenate([[0.0, 0.0], y]), where="post",
                        label=labels[i] if labels else _run_label(run["config"]))
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


def _server_gauges(plt, gauges: dict[str, Any]):
    """Running / waiting requests and KV-cache usage over the run, as the server saw them."""
    fig, ax = plt.subplots(figsize=(10, 3.2))
    for key, label in (("running", "requests running"), ("waiting", "requests waiting")):
        if key in gauges:
            t, v = zip(*gauges[key]["series"])
            ax.step(t, v, where="post", label=label)
    ax.set_xlabel("seconds since the first scrape")
    ax.set_ylabel("requests")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if "kv_cache_usage" in gauges:
        ax2 = ax.twinx()
        t, v = zip(*gauges["kv_cache_usage"]["series"])
        ax2.plot(t, [100 * x for x in v], color="tab:purple", label="KV cache used (%)")
        ax2.set_ylim(0, 100)
        ax2.set_ylabel("KV cache used (%)")
        ax2.legend(fontsize=8, loc="upper right")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("Server gauges (scraped /metrics)")
    return fig
