"""Client against server: the same run seen from both ends, side by side.

The client's numbers include the network, HTTP and SSE framing and its own scheduling;
the server's start when it received the request. A difference over 5% means one of the
two is not measuring what you think (a busy client, a proxy, a queue before the
server, or a metric defined differently) and is printed as a warning. For a latency
mean the gap must also exceed 10 ms: below that it is the transport itself (HTTP
parsing, SSE framing, the loopback, two processes' scheduling: 2-5 ms measured against
a local tokenmill on 2 busy cores), which is 5% of an 80 ms TTFT.
"""

from __future__ import annotations

from typing import Any

from tokenmill.bench.client import RequestRecord

WARN_PCT = 5.0
WARN_MS = 10.0  # latency rows: the smallest gap (client - server) worth a warning

# (row, client summary field, server latency key); the client side is always a mean
LATENCY_ROWS = (("TTFT mean (ms)", "ttft_ms", "ttft"), ("ITL mean (ms)", "itl_ms", "itl"),
                ("TPOT mean (ms)", "tpot_ms", "tpot"), ("E2E mean (ms)", "e2e_ms", "e2e"))


def timings_section(records: list[RequestRecord]) -> dict[str, Any]:
    """The `server` block from llama-server's per-response `timings` objects:
    prompt_ms is its prompt processing (≈ TTFT without queueing or network),
    predicted_per_token_ms its decode time per generated token (≈ TPOT)."""
    ts = [r.server_timings for r in records if r.ok and r.server_timings]
    out: dict[str, Any] = {"available": bool(ts), "source": "timings", "scheme": "llamacpp",
                           "latency": {}, "counters": {}, "gauges": {}}
    if not ts:
        out["reason"] = "no /metrics and no `timings` in the responses"
        return out

    def mean(key: str) -> float | None:
        vals = [float(t[key]) for t in ts if t.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    out["latency"]["ttft"] = {"metric": "timings.prompt_ms", "count": len(ts),
                              "mean_ms": mean("prompt_ms")}
    out["latency"]["tpot"] = {"metric": "timings.predicted_per_token_ms", "count": len(ts),
                              "mean_ms": mean("predicted_per_token_ms")}
    out["counters"]["prompt_tokens"] = sum(int(t.get("prompt_n") or 0) for t in ts)
    out["counters"]["generation_tokens"] = sum(int(t.get("predicted_n") or 0) for t in ts)
    if any(t.get("cache_n") is not None for t in ts):  # prompt tokens reused from its cache
        cached = sum(int(t.get("cache_n") or 0) for t in ts)
        out["prefix_cache_hit_rate"] = cached / max(1, cached + out["counters"]["prompt_tokens"])
    return out


def reconcile(summary: dict[str, Any], server: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of (what, client, server, diff %, warn): latency means, token and request
    counts. diff % = 100 × (client − server) / server; warn when |diff| > 5% (and, for
    a latency mean, |client − server| > 10 ms)."""
    rows = []
    lat = server.get("latency", {})
    for label, client_key, server_key in LATENCY_ROWS:
        s = lat.get(server_key, {}).get("mean_ms")
        c = summary.get(client_key, {}).get("mean")
        if server_key == "itl" and summary.get("itl_pooled_ms") is not None:
            c = summary["itl_pooled_ms"]  # the server counts every token it generated
        if s is not None and c is not None:
            rows.append(_row(label, c, s, floor=WARN_MS))
    counters = server.get("counters", {})
    for label, client_key, server_key in (
            ("output tokens", "total_output_tokens", "generation_tokens"),
            ("input tokens", "total_input_tokens", "prompt_tokens")):
        if counters.get(server_key) is not None:
            rows.append(_row(label, summary[client_key], counters[server_key]))
    if "e2e" in lat and server.get("source") == "metrics":
        rows.append(_row("requests finished", summary["num_completed"], lat["e2e"]["count"]))
    return rows


def _row(what: str, client: float, server: float, floor: float = 0.0) -> dict[str, Any]:
    diff = 100.0 * (client - server) / server if server else None
    return {"what": what, "client": client, "server": server, "diff_pct": diff,
            "warn": diff is not None and abs(diff) > WARN_PCT and abs(client - server) > floor}


def reconcile_notes(server: dict[str, Any]) -> list[str]:
    notes = []
    if not server.get("available"):
        return notes
    for row in server.get("reconciliation", []):
        if row["warn"]:
            notes.append(f"client and server disagree on {row['what']} by "
                         f"{row['diff_pct']:+.1f}% (client {row['client']:,.2f}, server "
                         f"{row['server']:,.2f}; > {WARN_PCT:g}%"
                         + (f" and > {WARN_MS:g} ms)" if "(ms)" in row["what"] else ")"))
    return notes
