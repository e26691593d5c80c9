"""The machine's own power during a run, where it tells: NVML on NVIDIA GPUs (power and
utilization sampled, and the driver's energy counter where it has one), RAPL through
/sys/class/powercap on a CPU (package energy counters; most VMs do not expose them).

Power is read on the host that runs the load generator: it is the server's only when the
server runs here (the result says which). The energy gives joules per output token and,
at a stated $ per kWh, the electricity in $ per 1M output tokens — beside the price-per-
hour model, which is what renting the machine costs.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

POWERCAP = Path("/sys/class/powercap")


def _rapl_domains(root: Path = POWERCAP) -> list[Path]:
    """Top-level package domains (intel-rapl:0, intel-rapl:1; AMD's are named the same),
    not their subzones (core, dram), which the package already counts."""
    return sorted(p for p in root.glob("intel-rapl:*") if p.name.count(":") == 1)


class RaplReader:
    def __init__(self, root: Path = POWERCAP) -> None:
        self.domains = _rapl_domains(root)
        self.why = None
        if not root.exists():
            self.why = (f"{root} does not exist (no RAPL driver: usual on VMs and "
                        f"containers)")
        elif not self.domains:
            self.why = f"{root} lists no RAPL package domain"
        else:
            try:
                self.read()
            except OSError as e:
                self.why = f"{self.domains[0] / 'energy_uj'} is not readable ({e.strerror}; " \
                           f"root only since 2020's PLATYPUS fix)"

    @property
    def available(self) -> bool:
        return self.why is None

    def read(self) -> list[int]:
        return [int((d / "energy_uj").read_text()) for d in self.domains]

    def max_ranges(self) -> list[int]:
        out = []
        for d in self.domains:
            try:
                out.append(int((d / "max_energy_range_uj").read_text()))
            except (OSError, ValueError):
                out.append(2**32)
        return out


class NvmlSampler:
    """Power (W) and utilization (%) of every GPU, sampled every `interval_s` in a thread."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.why = None
        self.handles: list[Any] = []
        try:
            import pynvml
        except ImportError:
            self.why = "pynvml is not installed (pip install nvidia-ml-py)"
            return
        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                            for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as e:
            self.why = f"NVML: {e} (no NVIDIA GPU or driver here)"
            return
        if not self.handles:
            self.why = "NVML lists no GPU"

    @property
    def available(self) -> bool:
        return self.why is None

    def start(self) -> None:
        self.samples: list[tuple[float, float, float]] = []  # (t, watts, util %)
        self.stop_event = threading.Event()
        self.energy0 = self._energy_mj()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _energy_mj(self) -> float | None:
        try:
            return float(sum(self.nvml.nvmlDeviceGetTotalEnergyConsumption(h)
                             for h in self.handles))
        except self.nvml.NVMLError:  # pre-Volta: no counter, integrate the samples
            return None

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                watts = sum(self.nvml.nvmlDeviceGetPowerUsage(h) for h in self.handles) / 1e3
                util = sum(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu
                           for h in self.handles) / len(self.handles)
                self.samples.append((time.perf_counter(), watts, util))
            except self.nvml.NVMLError:
                pass
            self.stop_event.wait(self.interval_s)

    def stop(self, wall_s: float) -> dict[str, Any]:
        self.stop_event.set()
        self.thread.join()
        energy1 = self._energy_mj()
        watts = [w for _, w, _ in self.samples]
        mean_w = sum(watts) / len(watts) if watts else None
        if self.energy0 is not None and energy1 is not None:
            energy_j, how = (energy1 - self.energy0) / 1e3, "NVML energy counter"
        else:
            energy_j = None if mean_w is None else mean_w * wall_s
            how = "NVML power samples × duration"
        return {"source": "nvml", "devices": len(self.handles), "energy_j": energy_j,
                "energy_basis": how, "mean_power_w": mean_w,
                "max_power_w": max(watts, default=None),
                "mean_utilization_pct": (sum(u for *_, u in self.samples) / len(self.samples)
                                         if self.samples else None),
                "num_samples": len(self.samples)}


class PowerMeter:
    """NVML where a GPU answers, else RAPL where readable, else nothing (and why)."""

    def __init__(self, interval_s: float = 0.1, powercap: Path = POWERCAP) -> None:
        self.nvml = NvmlSampler(interval_s)
        self.rapl = RaplReader(powercap)
        self.source = "nvml" if self.nvml.available else "rapl" if self.rapl.available \
            else None

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.source == "nvml":
            self.nvml.start()
        elif self.source == "rapl":
            self.rapl0 = self.rapl.read()

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.t0
        if self.source == "nvml":
            out = self.nvml.stop(wall)
        elif self.source == "rapl":
            now = self.rapl.read()
            uj = sum((b - a) % r for a, b, r in zip(self.rapl0, now, self.rapl.max_ranges()))
            out = {"source": "rapl", "domains": [d.name for d in self.rapl.domains],
                   "energy_j": uj / 1e6, "energy_basis": "RAPL package energy counters",
                   "mean_power_w": uj / 1e6 / wall if wall > 0 else None}
        else:
            return {"source": None, "available": False,
                    "why": f"no power reading on this host: GPU: {self.nvml.why}; CPU RAPL: "
                           f"{self.rapl.why}; cost comes from --cost-per-hour alone"}
        return {**out, "available": True, "wall_s": wall}


def power_summary(power: dict[str, Any], output_tokens: int,
                  price_per_kwh: float | None, same_host: bool | None) -> dict[str, Any]:
    """Joules per output token, and the electricity's $ per 1M output tokens."""
    out = dict(power, same_host_as_server=same_host)
    energy = power.get("energy_j")
    if energy is None or not output_tokens:
        return out
    jpt = energy / output_tokens
    out["joules_per_output_token"] = jpt
    out["price_per_kwh"] = price_per_kwh
    if price_per_kwh is not None:
        out["energy_cost_per_1m_output_tokens"] = jpt * 1e6 / 3.6e6 * price_per_kwh
    return out


def power_label(p: dict[str, Any]) -> str:
    """One line for the console and the report."""
    if not p.get("available"):
        return p.get("why", "not measured")
    parts = [f"{p['energy_j']:,.1f} J ({p['source']}, {p['energy_basis']})"]
    if p.get("mean_power_w") is not None:
        parts.append(f"mean {p['mean_power_w']:,.1f} W")
    if p.get("mean_utilization_pct") is not None:
        parts.append(f"GPU util {p['mean_utilization_pct']:.0f}%")
    if p.get("joules_per_output_token") is not None:
        parts.append(f"{p['joules_per_output_token']:.3g} J per output token")
    if p.get("energy_cost_per_1m_output_tokens") is not None:
        parts.append(f"${p['energy_cost_per_1m_output_tokens']:.4f} of electricity per 1M "
                     f"output tokens at ${p['price_per_kwh']:g}/kWh")
    if p.get("same_host_as_server") is False:
        parts.append("measured on the client's host, not the server's")
    return "; ".join(parts)
