"""Means with 95% confidence intervals, and the ratio of two paired series with its own.

Student's t on the repeats (these machines drift ±10–20% between runs minutes apart, so
one run is an anecdote). A ratio between two servers is taken per pair of runs (A and B
run back to back, A B B A …) on the log scale, so slow drift cancels within each pair and
the interval is the geometric mean's."""

from __future__ import annotations

import math
from collections.abc import Sequence

# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (no scipy here)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(df: int) -> float:
    if df < 1:
        raise ValueError("a confidence interval needs at least two values")
    if df <= len(_T975):
        return _T975[df - 1]
    return 1.960 + 2.4 / df  # within 0.1% of the exact value above 30 degrees of freedom


def mean_ci95(values: Sequence[float]) -> dict[str, object]:
    """{"mean", "ci95": [lo, hi], "std", "n", "values"}; with one value the interval is
    null (nothing to say about the spread)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(vals)
    if not n:
        return {"mean": None, "ci95": None, "std": None, "n": 0, "values": []}
    mean = sum(vals) / n
    if n == 1:
        return {"mean": mean, "ci95": None, "std": None, "n": 1, "values": vals}
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
    half = t_quantile_975(n - 1) * std / math.sqrt(n)
    return {"mean": mean, "ci95": [mean - half, mean + half], "std": std, "n": n,
            "values": vals}


def ratio_ci95(a: Sequence[float], b: Sequence[float]) -> dict[str, object]:
    """b / a over paired runs: the geometric mean of the per-pair ratios with its 95%
    interval (t on the log ratios). {"ratio", "ci95": [lo, hi], "n", "pairs"}."""
    pairs = [(x, y) for x, y in zip(a, b) if x and y and x > 0 and y > 0]
    logs = [math.log(y / x) for x, y in pairs]
    if not logs:
        return {"ratio": None, "ci95": None, "n": 0, "pairs": []}
    ci = mean_ci95(logs)
    lo_hi = None if ci["ci95"] is None else [math.exp(v) for v in ci["ci95"]]
    return {"ratio": math.exp(ci["mean"]), "ci95": lo_hi, "n": len(logs),
            "pairs": [y / x for x, y in pairs]}


def fmt_ci(stat: dict[str, object], digits: int = 3) -> str:
    """"12.3 [11.9, 12.8]" for a table cell."""
    mean = stat.get("mean", stat.get("ratio"))
    if mean is None:
        return "—"
    if not stat.get("ci95"):
        return f"{mean:.{digits}g}"
    lo, hi = stat["ci95"]
    return f"{mean:.{digits}g} [{lo:.{digits}g}, {hi:.{digits}g}]"
