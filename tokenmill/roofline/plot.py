"""Log–log roofline chart: arithmetic intensity (FLOP/byte) vs FLOP/s, with the bandwidth
roof, a compute roof per dtype, the model's decode points per batch, prefill, and measured
points."""

from __future__ import annotations

import math

from tokenmill.roofline import fmt
from tokenmill.roofline.cost_model import RooflineReport

ROOF_COLOR = "#222222"
DECODE_COLOR = "#1f77b4"
PREFILL_COLOR = "#2ca02c"
MEASURED_COLOR = "#d62728"
LABEL_GAP_DECADES = 0.35


def plot_roofline(path: str, report: RooflineReport,
                  measured: list[tuple[str, float, float]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = report.machine
    bw, peak = m.bandwidth_bytes_s, m.peak_flops
    points = [(row.step.intensity, min(peak, bw * row.step.intensity), row) for row in report.rows]
    xs = [p[0] for p in points] + [report.prefill.intensity, m.ridge_intensity]
    xs += [x for _, x, _ in measured or []]
    x_lo, x_hi = min(xs) / 4, max(xs) * 4
    other_peaks = {d: f * m.num_gpus for d, f in report.hardware.peak_flops.items()
                   if d in ("fp32", "bf16", "fp8") and d != m.compute_dtype}
    ys = [peak, *other_peaks.values(), bw * x_lo] + [y for _, _, y in measured or []]
    y_lo = min(ys) / 4

    fig, ax = plt.subplots(figsize=(9, 6.6), dpi=120)
    ax.set_xscale("log")
    ax.set_yscale("log")
    grid = [x_lo * (x_hi / x_lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(peak, bw * x) for x in grid], color=ROOF_COLOR, lw=2.5, zorder=2,
            label=f"roof: {fmt.si(bw, 'B/s')} × intensity, capped at {m.compute_dtype} "
                  f"{fmt.si(peak, 'FLOP/s')}")
    ax.fill_between(grid, [min(peak, bw * x) for x in grid], y_lo, color="#f0f0f0", zorder=0)
    for dtype, other in other_peaks.items():
        ax.plot([other / bw, x_hi], [other, other], color="#999999", lw=1, ls="--", zorder=1)
        ax.annotate(f"{dtype} peak {fmt.si(other, 'FLOP/s')}", (x_hi, other),
                    xytext=(-4, 3), textcoords="offset points", ha="right", fontsize=8,
                    color="#777777")
    ax.axvline(m.ridge_intensity, color="#bbbbbb", lw=1, ls=":", zorder=1)
    ax.annotate(f"ridge {m.ridge_intensity:,.0f} FLOP/B", (m.ridge_intensity, y_lo),
                xytext=(4, 6), textcoords="offset points", fontsize=8, color="#777777")

    ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color=DECODE_COLOR, ms=7,
            lw=1, zorder=3, label=f"decode floor (context {report.context:,})")
    last_x, side = 0.0, 0
    for i, (x, y, row) in enumerate(points):
        # label only points far enough apart, alternating sides of the roof, so they don't
        # overprint; the last batch is always labeled
        if i != len(points) - 1 and math.log10(x / last_x if last_x else 10) < LABEL_GAP_DECADES:
            continue
        last_x, side = x, side + 1
        above = side % 2 == 1
        label = f"batch {row.batch}: {fmt.ms(row.step.time_s)}, {fmt.tok_s(row.tok_s_total)} tok/s"
        ax.annotate(label, (x, y), xytext=(-8, 8) if above else (8, -10),
                    textcoords="offset points", ha="right" if above else "left",
                    va="bottom" if above else "top", fontsize=7.5,
                    color=DECODE_COLOR if row.fits else "#aaaaaa")
        if not row.fits:
            ax.plot([x], [y], "x", color="#aaaaaa", ms=10, zorder=4)
    pre = report.prefill
    pre_y = min(peak, bw * pre.intensity)
    ax.plot([pre.intensity], [pre_y], "s", color=PREFILL_COLOR, ms=9, zorder=3,
            label=f"prefill floor, one {report.prompt_len:,}-token prompt: {fmt.ms(pre.time_s)}")
    for label, x, y in measured or []:
        ax.plot([x], [y], "*", color=MEASURED_COLOR, ms=15, zorder=5)
        roof = min(peak, bw * x)
        ax.plot([x, x], [y, roof], color=MEASURED_COLOR, lw=1, ls="--", zorder=4)
        ax.annotate(f"{label}\n{y / roof:.0%} of roof", (x, y), xytext=(9, -7),
                    textcoords="offset points", va="top", fontsize=8, color=MEASURED_COLOR,
                    zorder=6, bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none",
                                    "alpha": 0.85})
    if measured:
        ax.plot([], [], "*", color=MEASURED_COLOR, ms=12, label="measured")

    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(y_lo, max(ys) * 3)
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("FLOP/s")
    gpus = f" ×{m.num_gpus}" if m.num_gpus > 1 else ""
    ax.set_title(f"{report.model}, {report.dtype} weights, on {report.hardware.description}"
                 f"{gpus}", fontsize=11)
    ax.grid(True, which="major", color="#dddddd", lw=0.6)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize=8.5,
              frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
