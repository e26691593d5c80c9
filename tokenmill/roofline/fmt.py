"""Number formatting shared by the roofline and explain reports (SI units: 1 GB = 10⁹ B)."""

from __future__ import annotations


def _sig(value: float, digits: int) -> str:
    """`digits` significant figures, keeping trailing zeros (1.00, not 1) but no bare '.'."""
    return f"{value:#.{digits}g}".rstrip(".")


def si(value: float, unit: str, digits: int = 3) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{_sig(value / factor, digits)} {prefix}{unit}"
    return f"{_sig(value, digits)} {unit}"


def num_bytes(value: float) -> str:
    return si(value, "B", 4)


def ms(seconds: float) -> str:
    value = seconds * 1e3
    return f"{_sig(value, 3)} ms" if value < 100 else f"{value:,.0f} ms"


def tok_s(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def dollars(value: float) -> str:
    if value >= 100:
        return f"${value:,.0f}"
    return f"${value:.2f}" if value >= 0.1 else f"${value:.3g}"


def pct(fraction: float) -> str:
    return f"{fraction * 100:.0f}%" if fraction >= 0.1 else f"{fraction * 100:.2g}%"


def params(value: float) -> str:
    return f"{value / 1e9:.2f} B" if value >= 1e9 else f"{value / 1e6:.1f} M"
