"""The Pareto front of a sweep: output tok/s per user (1 / TPOT) against output tok/s per
device, one point per run, as `vllm bench sweep` and InferenceX draw it.

A point is on the front when no other point is at least as good on both axes and better
on one. Along the front, sorted by throughput per device, speed per user only falls. The
SLO line is the per-user speed a TPOT SLO asks for (1000 / tpot_ms). The knee is the front
point past which more throughput costs the most per-user speed (the point farthest from
the chord joining the front's ends, both axes scaled to their range), unless an SLO is
given: then it is the highest-throughput point that still meets it.
"""

from __future__ import annotations

from typing import Any

X_KEY = "output_tok_s_per_device"
Y_KEY = "output_tok_s_per_user"


def point_of(run: dict[str, Any], num_devices: int) -> dict[str, Any] | None:
    """One run's point; None when no request produced two tokens (no TPOT)."""
    s = run["summary"]
    tpot = (s.get("tpot_ms") or {}).get("mean")
    if not tpot or tpot <= 0:
        return None
    cfg = run.get("config") or {}
    return {X_KEY: s["output_throughput_tok_s"] / max(1, num_devices),
            Y_KEY: 1000.0 / tpot, "concurrency": cfg.get("concurrency"),
            "request_rate": cfg.get("request_rate")}


def front_indices(points: list[dict[str, Any]]) -> list[int]:
    """Indices of the non-dominated points, by throughput per device ascending."""
    idx = []
    for i, p in enumerate(points):
        dominated = any(q[X_KEY] >= p[X_KEY] and q[Y_KEY] >= p[Y_KEY]
                        and (q[X_KEY] > p[X_KEY] or q[Y_KEY] > p[Y_KEY])
                        for j, q in enumerate(points) if j != i)
        if not dominated:
            idx.append(i)
    return sorted(idx, key=lambda i: (points[i][X_KEY], -points[i][Y_KEY]))


def knee_index(points: list[dict[str, Any]], front: list[int],
               slo_tok_s_per_user: float | None) -> int | None:
    if not front:
        return None
    if slo_tok_s_per_user is not None:
        ok = [i for i in front if points[i][Y_KEY] >= slo_tok_s_per_user]
        return max(ok, key=lambda i: points[i][X_KEY]) if ok else None
    if len(front) < 3:
        return front[-1]
    xs = [points[i][X_KEY] for i in front]
    ys = [points[i][Y_KEY] for i in front]
    sx, sy = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    nx = [(x - xs[0]) / sx for x in xs]
    ny = [(y - ys[-1]) / sy for y in ys]
    # distance above the chord from (0, 1) to (1, 0), in the scaled square
    dist = [x + y - 1.0 for x, y in zip(nx, ny)]
    return front[max(range(len(front)), key=dist.__getitem__)]


def pareto_section(runs: list[dict[str, Any]], parameter: str, num_devices: int = 1,
                   tpot_slo_ms: float | None = None) -> dict[str, Any]:
    """The `pareto` block of a sweep's JSON; `pareto_front` lists the front's points."""
    points, run_of = [], []
    for k, r in enumerate(runs):
        p = point_of(r, num_devices)
        if p is not None:
            points.append(dict(p, run_index=k))
            run_of.append(k)
    front = front_indices(points)
    slo = 1000.0 / tpot_slo_ms if tpot_slo_ms else None
    knee = knee_index(points, front, slo)
    return {"x": X_KEY, "y": Y_KEY, "parameter": parameter, "num_devices": num_devices,
            "points": points, "front": [points[i] for i in front],
            "slo_tok_s_per_user": slo, "tpot_slo_ms": tpot_slo_ms,
            "knee": None if knee is None else points[knee]}


def describe_knee(pareto: dict[str, Any]) -> str:
    """One sentence naming the knee, for `explain` and the console."""
    knee = pareto.get("knee")
    if knee is None:
        if pareto.get("slo_tok_s_per_user"):
            return (f"no point of the sweep meets the TPOT SLO of "
                    f"{pareto['tpot_slo_ms']:g} ms ({pareto['slo_tok_s_per_user']:.1f} "
                    f"tok/s per user)")
        return "the sweep has no point with a TPOT (every request made one token)"
    where = (f"concurrency {knee['concurrency']}" if pareto["parameter"] == "concurrency"
             else f"{knee['request_rate']:g} req/s")
    text = (f"knee of the Pareto front at {where}: {knee[X_KEY]:.1f} output tok/s per "
            f"device at {knee[Y_KEY]:.1f} tok/s per user")
    front = pareto["front"]
    k = next(i for i, p in enumerate(front) if p["run_index"] == knee["run_index"])
    if k + 1 < len(front):
        nxt = front[k + 1]
        gain = 100 * (nxt[X_KEY] / knee[X_KEY] - 1)
        loss = 100 * (1 - nxt[Y_KEY] / knee[Y_KEY])
        text += f"; the next front point buys {gain:+.0f}% throughput for {loss:.0f}% " \
                f"of each user's speed"
    if pareto.get("slo_tok_s_per_user"):
        text += f" (the best point meeting TPOT ≤ {pareto['tpot_slo_ms']:g} ms)"
    return text


def pareto_figure(plt, results: list[dict[str, Any]], names: list[str]):
    """Every run as a point, each result's front as a line, the knee circled, the SLO
    line dashed; several results overlay (e.g. tokenmill vs vLLM on one machine)."""
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for n, (res, name) in enumerate(zip(results, names)):
        par = res["pareto"]
        color = f"C{n}"
        ax.scatter([p[X_KEY] for p in par["points"]], [p[Y_KEY] for p in par["points"]],
                   color=color, alpha=0.35, s=18)
        ax.plot([p[X_KEY] for p in par["front"]], [p[Y_KEY] for p in par["front"]], "o-",
                color=color, label=f"{name} front")
        for p in par["points"]:
            label = (f"c={p['concurrency']}" if par["parameter"] == "concurrency"
                     else f"{p['request_rate']:g}/s")
            ax.annotate(label, (p[X_KEY], p[Y_KEY]), xytext=(3, 4),
                        textcoords="offset points", fontsize=7)
        if par.get("knee"):
            ax.scatter([par["knee"][X_KEY]], [par["knee"][Y_KEY]], s=160,
                       facecolors="none", edgecolors=color, linewidths=1.5)
    slo = next((r["pareto"]["slo_tok_s_per_user"] for r in results
                if r["pareto"].get("slo_tok_s_per_user")), None)
    if slo:
        ax.axhline(slo, color="red", linestyle="--", linewidth=1,
                   label=f"SLO: {slo:.1f} tok/s per user")
    ax.set_xlabel("output tok/s per device")
    ax.set_ylabel("output tok/s per user (1 / TPOT)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Pareto front: per-user speed vs throughput per device")
    return fig
