"""A path's row of the gate's table: the four figures with their intervals, and the
rule that decides whether a path may be the default."""

from __future__ import annotations

import numpy as np

from benchmarks.accuracy_gate.bootstrap import chunk_bootstrap
from benchmarks.accuracy_gate.kld import PositionFigures

PPL_TOLERANCE = 0.01  # perplexity within 1% of the reference


def summarize(fig: PositionFigures, per_chunk: int, resamples: int = 1000) -> dict:
    """Mean KLD, its p99, same-top %, perplexity (of the path and the reference)
    and their ratio: value and 95% interval each, bootstrapped over chunks."""
    n = len(fig.kld)
    if n % per_chunk:
        raise ValueError(f"{n} positions are not whole chunks of {per_chunk}")
    chunks = n // per_chunk

    def ci(stat) -> dict:
        value, low, high = chunk_bootstrap(chunks, per_chunk, stat, resamples)
        return {"value": value, "low": low, "high": high}

    return {
        "positions": n, "chunks": chunks,
        "kld_mean": ci(lambda i: fig.kld[i].mean()),
        "kld_p99": ci(lambda i: np.percentile(fig.kld[i], 99)),
        "same_top_pct": ci(lambda i: 100.0 * fig.same_top[i].mean()),
        "ppl_ratio": ci(lambda i: np.exp(fig.nll[i].mean() - fig.nll_ref[i].mean())),
        "ppl": float(np.exp(fig.nll.mean())),
        "ppl_reference": float(np.exp(fig.nll_ref.mean())),
    }


def verdict(row: dict, llama: dict | None) -> tuple[bool | None, str]:
    """The rule (issue 57): a path may be the default when its mean KLD's interval
    does not lie above llama.cpp's on the same file (its low end is not above
    llama.cpp's high end) and its perplexity is within 1% of the reference.
    None when llama.cpp's figures are missing (no verdict without the anchor)."""
    ratio = row["ppl_ratio"]["value"]
    ppl_ok = abs(ratio - 1.0) <= PPL_TOLERANCE
    if llama is None:
        return None, "no llama.cpp figures on this file"
    ours, theirs = row["kld_mean"], llama["kld_mean"]
    kld_ok = ours["low"] <= theirs["high"]
    why = []
    if not kld_ok:
        why.append(f"KLD [{ours['low']:.5f}, {ours['high']:.5f}] lies above llama.cpp's "
                   f"[{theirs['low']:.5f}, {theirs['high']:.5f}]")
    if not ppl_ok:
        why.append(f"perplexity ratio {ratio:.4f} is not within 1%")
    return kld_ok and ppl_ok, "; ".join(why) or "passes"


def _ci(x: dict, fmt: str) -> str:
    return f"{x['value']:{fmt}} [{x['low']:{fmt}}, {x['high']:{fmt}}]"


def table(rows: list[dict]) -> str:
    """Markdown, one line per path (the llama.cpp row first)."""
    head = ("| path | engine | KLD mean [95%] | KLD p99 [95%] | same top % [95%] | "
            "PPL ratio [95%] | PPL | verdict |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['path']} | - | {r['error']} | | | | | not run |")
            continue
        ok = r.get("passes")
        mark = "n/a" if ok is None else ("PASS" if ok else "FAIL")
        if r.get("anchor"):
            mark = "anchor"
        used = ", ".join(f"{k} {v:g}%" for k, v in (r.get("routes") or {}).items())
        engine = f"{r['engine']}; linear rows: {used}" if used else r["engine"]
        lines.append(
            f"| {r['path']} | {engine} | {_ci(r['kld_mean'], '.5f')} | "
            f"{_ci(r['kld_p99'], '.4f')} | {_ci(r['same_top_pct'], '.2f')} | "
            f"{_ci(r['ppl_ratio'], '.4f')} | {r['ppl']:.4f} | {mark} |")
    return "\n".join(lines)
