"""`--html report.html`: one self-contained file (plots as data-URI PNGs, inline CSS, no
network): summary, latency percentiles, client vs server, the client's own cost, the
runs of a sweep, the explain verdict when the hardware is known, the plots and notes.
`--compare` results render as one page too.

Every number is a table cell carrying `data-key` (its path in the result JSON), so a
reader (or a test) can find it; a few lines of script mark any image that failed to
load and count the loaded ones in `body[data-images-loaded]`.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
from pathlib import Path
from typing import Any

from tokenmill.bench.compare import compare_rows, config_differences, fmt_value
from tokenmill.bench.report import LATENCIES, load_label

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px;
       color: #1d232a; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.1em; } h2 { margin-top: 1.6em; font-size: 1.2em;
  border-bottom: 1px solid #d5dae0; padding-bottom: 0.2em; }
.sub { color: #5b6570; margin-top: 0; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #e6e9ed; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f3f5f7; text-align: left; }
.warn { color: #b3261e; font-weight: 600; } .better { color: #137333; font-weight: 600; }
.worse { color: #b3261e; font-weight: 600; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #e6e9ed; }
figcaption { color: #5b6570; font-size: 0.9em; }
.note { background: #fff8e1; border-left: 4px solid #f2b705; padding: 0.3em 0.7em;
        margin: 0.3em 0; }
"""
SCRIPT = """
window.addEventListener("load", () => {
  const imgs = Array.from(document.images);
  const bad = imgs.filter((i) => !(i.complete && i.naturalWidth > 0));
  document.body.dataset.imagesLoaded = String(imgs.length - bad.length);
  document.body.dataset.imagesBroken = String(bad.length);
  bad.forEach((i) => i.insertAdjacentHTML("afterend",
    '<p class="warn">this image failed to load</p>'));
});
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _num(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _e(v)
    if isinstance(v, int) or float(v).is_integer() and abs(v) >= 10:
        return f"{v:,.0f}"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:,.{digits}f}"


def _cell(v: Any, key: str, cls: str = "num") -> str:
    return f'<td class="{cls}" data-key="{_e(key)}">{_num(v)}</td>'


def _table(head: list[str], rows: list[str]) -> str:
    ths = "".join(f'<th class="{"num" if i else ""}">{_e(h)}</th>' for i, h in enumerate(head))
    return f"<table><tr>{ths}</tr>{''.join(rows)}</table>"


def _page(title: str, subtitle: str, body: list[str]) -> str:
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{_e(title)}</h1><p class=\"sub\">{_e(subtitle)}</p>{''.join(body)}"
            f"<script>{SCRIPT}</script></body></html>\n")


def _figures(figs: list[tuple[str, str, Any]]) -> str:
    out = ['<section id="plots"><h2>Plots</h2>']
    for name, caption, fig in figs:
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=100)
        data = base64.b64encode(buf.getvalue()).decode("ascii")
        out.append(f'<figure id="plot-{_e(name)}"><img alt="{_e(caption)}" '
                   f'src="data:image/png;base64,{data}"><figcaption>{_e(caption)}'
                   f"</figcaption></figure>")
    out.append("</section>")
    return "".join(out)


# ---- one result ------------------------------------------------------------------------


def _summary(s: dict[str, Any]) -> str:
    rows = [("requests completed", s["num_completed"], "summary.num_completed"),
            ("requests failed", s["num_failed"], "summary.num_failed"),
            ("duration (s)", s["duration_s"], "summary.duration_s"),
            ("request throughput (req/s)", s["request_throughput"],
             "summary.request_throughput"),
            ("output throughput (tok/s)", s["output_throughput_tok_s"],
             "summary.output_throughput_tok_s"),
            ("total throughput (tok/s)", s["total_throughput_tok_s"],
             "summary.total_throughput_tok_s"),
            ("mean in-flight requests", s["mean_in_flight"], "summary.mean_in_flight"),
            ("mean input / output tokens", None, None),
            ("goodput (req/s)", s.get("goodput_req_s"), "summary.goodput_req_s"),
            ("SLO attainment (%)", s.get("slo_attainment"), "summary.slo_attainment"),
            ("$ per 1M output tokens", s.get("cost_per_1m_output_tokens"),
             "summary.cost_per_1m_output_tokens")]
    out = []
    for label, v, key in rows:
        if key is None:
            out.append(f"<tr><th>{_e(label)}</th><td class=\"num\">"
                       f"{_num(s['mean_input_tokens'], 1)} / {_num(s['mean_output_tokens'], 1)}"
                       f"</td></tr>")
        elif v is not None:
            out.append(f"<tr><th>{_e(label)}</th>{_cell(v, key)}</tr>")
    if s.get("power"):
        from tokenmill.bench.power import power_label

        jpt = s["power"].get("joules_per_output_token")
        if jpt is not None:
            out.append(f"<tr><th>joules per output token</th>"
                       f"{_cell(jpt, 'summary.power.joules_per_output_token')}</tr>")
        out.append(f"<tr><th>energy</th><td>{_e(power_label(s['power']))}</td></tr>")
    if s["failures"]:
        out.append(f"<tr><th>failures</th><td class=\"warn\">"
                   f"{_e(', '.join(f'{k}: {v}' for k, v in s['failures'].items()))}</td></tr>")
    return f'<section id="summary"><h2>Summary</h2><table>{"".join(out)}</table></section>'


def _latency(s: dict[str, Any]) -> str:
    cols = ("mean", "std", "p50", "p90", "p95", "p99", "max")
    rows = [f"<tr><th>{name}</th>" + "".join(_cell(s[key][c], f"summary.{key}.{c}")
                                             for c in cols) + "</tr>"
            for name, key in LATENCIES]
    return ('<section id="latency"><h2>Latency (ms)</h2>'
            + _table(["metric", *cols], rows) + "</section>")


def _server(server: dict[str, Any]) -> str:
    head = '<section id="server"><h2>Client vs server</h2>'
    if not server.get("available"):
        return head + f"<p>No server-side numbers: {_e(server.get('reason'))}</p></section>"
    rows = []
    for i, r in enumerate(server.get("reconciliation", [])):
        diff = "-" if r["diff_pct"] is None else f"{r['diff_pct']:+.1f}%"
        rows.append(f"<tr><th>{_e(r['what'])}</th>"
                    f"{_cell(r['client'], f'server.reconciliation.{i}.client')}"
                    f"{_cell(r['server'], f'server.reconciliation.{i}.server')}"
                    f'<td class="num{" warn" if r["warn"] else ""}">{diff}</td></tr>')
    lat_rows = []
    for key, st in server.get("latency", {}).items():
        lat_rows.append(f"<tr><th>{_e(key)} <small>({_e(st['metric'])})</small></th>"
                        + "".join(_cell(st.get(c), f"server.latency.{key}.{c}")
                                  for c in ("count", "mean_ms", "p50_ms", "p90_ms", "p99_ms"))
                        + "</tr>")
    gauges = [f"<tr><th>{_e(k)}</th>{_cell(g['mean'], f'server.gauges.{k}.mean')}"
              f"{_cell(g['max'], f'server.gauges.{k}.max')}</tr>"
              for k, g in server.get("gauges", {}).items()]
    hit = server.get("prefix_cache_hit_rate")
    return (head + f"<p>Source: {_e(server['scheme'])} {_e(server['source'])}. diff = "
            f"(client − server) ÷ server; over 5% is flagged. Server quantiles are "
            f"interpolated inside histogram buckets (as Prometheus does), so they are only "
            f"as fine as the buckets.</p>"
            + _table(["", "client", "server", "diff"], rows)
            + "<h3>The server's own latency (from its histograms)</h3>"
            + _table(["", "count", "mean (ms)", "p50", "p90", "p99"], lat_rows)
            + ("<h3>Server gauges during the run</h3>"
               + _table(["", "mean", "max"], gauges) if gauges else "")
            + (f"<p>Prefix-cache hit rate: <span data-key=\"server.prefix_cache_hit_rate\">"
               f"{100 * hit:.1f}%</span></p>" if hit is not None else "")
            + "</section>")


def _client(c: dict[str, Any]) -> str:
    lag = c["loop_lag_ms"]
    rows = [(f"<tr><th>CPU seconds (all generator processes and threads)</th>"
            f"{_cell(c['cpu_seconds'], 'client.cpu_seconds')}</tr>"),
            (f"<tr><th>share of the machine (0..1 of {c['num_cpus']} CPUs)</th>"
            f'{_cell(c["cpu_share"], "client.cpu_share", "num warn" if c["warning"] else "num")}'
            f"</tr>"),
            f"<tr><th>generator processes</th>{_cell(c['workers'], 'client.workers')}</tr>",
            (f"<tr><th>event-loop lag p99 / max (ms)</th><td class=\"num\">"
            f"{_num(lag['p99'])} / {_num(lag['max'])}</td></tr>"),
            f"<tr><th>same host as the server</th><td>{_e(c['same_host'])}</td></tr>"]
    return ('<section id="client"><h2>The client\'s own cost</h2>'
            f"<table>{''.join(rows)}</table></section>")


def _engine(e: dict[str, Any]) -> str:
    """Offline runs: where the engine's wall time went, phase by phase."""
    wall = e["wall_time_s"] or 1.0
    rows = [f"<tr><th>{_e(phase)}</th>{_cell(v, f'engine.time_s.{phase}')}"
            f'<td class="num">{100 * v / wall:.1f}%</td></tr>'
            for phase, v in e["time_s"].items()]
    return ('<section id="engine"><h2>Engine (offline)</h2>'
            f"<p>{e['num_steps']} steps, {e['num_prefill_tokens']} prefill + "
            f"{e['num_decode_tokens']} decode tokens, mean decode batch "
            f"{e['mean_decode_batch']:.1f}, wall {e['wall_time_s']:.3f} s.</p>"
            + _table(["phase", "seconds", "share of wall"], rows) + "</section>")


def _runs(result: dict[str, Any]) -> str:
    cols = ("load", "completed", "req/s", "output tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
            "TPOT p99", "goodput")
    rows = []
    for i, run in enumerate(result["runs"]):
        s, k = run["summary"], f"runs.{i}.summary"
        rows.append(f"<tr><th>{_e(load_label(run['config']))}</th>"
                    + _cell(s["num_completed"], f"{k}.num_completed")
                    + _cell(s["request_throughput"], f"{k}.request_throughput")
                    + _cell(s["output_throughput_tok_s"], f"{k}.output_throughput_tok_s")
                    + "".join(_cell(s[m][p], f"{k}.{m}.{p}") for m, p in (
                        ("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"),
                        ("tpot_ms", "p99")))
                    + _cell(s.get("goodput_req_s"), f"{k}.goodput_req_s") + "</tr>")
    return ('<section id="runs"><h2>Runs</h2><p>Latencies in ms; the summary above is run '
            f"{result.get('summary_run_index')}.</p>" + _table(list(cols), rows) + "</section>")


def _explain(result: dict[str, Any]) -> str:
    """The verdict of `tokenmill explain`, when the result names its hardware."""
    hardware = result["config"].get("hardware")
    if not hardware:
        return ""
    head = '<section id="explain"><h2>Against the hardware floor</h2>'
    try:
        from tokenmill.roofline.explain import explain

        ns = argparse.Namespace(result="this run", hardware=None, bandwidth=None, flops=None,
                                cost_per_hour=None)
        ex = explain(result, ns).to_dict()
    except Exception as e:  # noqa: BLE001 — the report must render without a verdict
        return head + f"<p>No verdict: {_e(type(e).__name__)}: {_e(e)}</p></section>"
    rows = []
    for phase in ("decode", "prefill"):
        d = ex.get(phase)
        if d:
            rows.append(f"<tr><th>{phase}</th>"
                        f"{_cell(d['fraction_of_floor'], f'explain.{phase}.fraction_of_floor')}"
                        f"{_cell(d['mfu'], f'explain.{phase}.mfu')}</tr>")
    lever = ex.get("next_lever")
    return (head + f"<p>On {_e(ex['hardware'])}: <strong>{_e(ex['bottleneck'])}</strong></p>"
            + (_table(["phase", "fraction of floor", "MFU"], rows) if rows else "")
            + (f"<p>Next lever: <strong>{_e(lever['name'])}</strong> — {_e(lever['why'])}</p>"
               if lever else "") + "</section>")


def render_report(result: dict[str, Any]) -> str:
    from tokenmill.bench.plots import figures, pyplot

    cfg = result["config"]
    body = [_summary(result["summary"]), _latency(result["summary"])]
    if "engine" in result:
        body.append(_engine(result["engine"]))
    if "server" in result:
        body.append(_server(result["server"]))
    if "client" in result:
        body.append(_client(result["client"]))
    if "runs" in result:
        body.append(_runs(result))
    body.append(_explain(result))
    figs = figures(result)
    body.append(_figures(figs))
    pyplot().close("all")
    if result.get("notes"):
        body.append('<section id="notes"><h2>Notes</h2>' + "".join(
            f'<p class="note">{_e(n)}</p>' for n in result["notes"]) + "</section>")
    sub = (f"{cfg.get('model')} · {cfg.get('backend')} {cfg.get('endpoint')} · "
           f"{load_label(cfg)} · {cfg.get('base_url') or 'in-process engine'}")
    return _page(f"tokenmill bench · {cfg.get('model')}", sub, body)


def render_comparison(names: list[str], results: list[dict[str, Any]]) -> str:
    from tokenmill.bench.plots import compare_figures, pyplot

    rows = []
    for row in compare_rows(results):
        cells = []
        for i, v in enumerate(row["values"]):
            cells.append(f'<td class="num" data-key="{_e(row["key"])}" data-run="{i}">'
                         f"{fmt_value(v)}</td>")
            if i:
                d = row["diff_pct"][i]
                cells.append(f'<td class="num {row["verdict"][i]}">'
                             f'{"-" if d is None else f"{d:+.1f}%"}</td>')
        rows.append(f"<tr><th>{_e(row['label'])}</th>{''.join(cells)}</tr>")
    head = ["metric"]
    for i, n in enumerate(names):
        head += [n] + (["diff"] if i else [])
    changed = "".join(f"<tr><th>{_e(k)}</th>" + "".join(f"<td>{_e(v)}</td>" for v in vals)
                      + "</tr>" for k, vals in config_differences(results))
    body = ['<section id="comparison"><h2>Side by side</h2><p>diff = (run − first) ÷ first; '
            "green is better, red worse (beyond 1%).</p>" + _table(head, rows) + "</section>"]
    if changed:
        body.append('<section id="changed"><h2>What changed</h2>'
                    + _table(["config", *names], [changed]) + "</section>")
    figs = compare_figures(results, names)
    body.append(_figures(figs))
    pyplot().close("all")
    return _page("tokenmill bench · comparison", " vs ".join(names), body)


def write_html(text: str, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text, encoding="utf-8")
