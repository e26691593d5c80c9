"""Hardware catalog (datasheet numbers, each with its source) and a measured CPU entry.

FLOP/s are dense peaks (NVIDIA datasheets print sparse figures with an asterisk; those are
halved here). `cost_per_hour` is a rough on-demand cloud price per device, only a default:
pass `--cost-per-hour` for your own.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tokenmill.cache import cache_dir
from tokenmill.cpuinfo import cpuinfo_field

T = 1e12
GB = 1e9


PEAK_FALLBACKS = {"fp8": ("fp8", "bf16", "fp16", "fp32"),
                  "fp16": ("fp16", "bf16", "fp32"),
                  "bf16": ("bf16", "fp16", "fp32"),
                  "int16": ("int16", "bf16", "fp16", "fp32"),
                  "int8": ("int8", "bf16", "fp16", "fp32")}


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    memory_bandwidth_bytes_s: float
    peak_flops: dict[str, float]  # compute dtype -> dense FLOP/s
    memory_bytes: float
    cost_per_hour: float
    source: str
    measured: dict = field(default_factory=dict)  # extra measured figures (CPU only)

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in `dtype` (that of `peak_dtype(dtype)`)."""
        return self.peak_flops[self.peak_dtype(dtype)]

    def peak_dtype(self, dtype: str) -> str:
        """The dtype whose peak a matmul in `dtype` is held against: itself where this
        hardware lists it, else the nearest wider one (the integer activations of a GGUF
        path, int16 and int8, are measured on CPUs only: elsewhere they read bf16's)."""
        for candidate in PEAK_FALLBACKS.get(dtype, (dtype, "fp32")):
            if candidate in self.peak_flops:
                return candidate
        return max(self.peak_flops, key=self.peak_flops.__getitem__)

    def with_overrides(self, bandwidth_gb_s: float | None, flops_tflops: float | None,
                       compute_dtype: str) -> Hardware:
        hw = self
        if bandwidth_gb_s is not None:
            hw = replace(hw, memory_bandwidth_bytes_s=bandwidth_gb_s * GB,
                         source=hw.source + "; bandwidth overridden")
        if flops_tflops is not None:
            hw = replace(hw, peak_flops={**hw.peak_flops, compute_dtype: flops_tflops * T},
                         source=hw.source + "; FLOP/s overridden")
        return hw


def _gpu(name, description, bw_gb_s, flops_t, memory_gb, cost, source) -> Hardware:
    return Hardware(name, description, bw_gb_s * GB, {k: v * T for k, v in flops_t.items()},
                    memory_gb * GB, cost, source)


CATALOG: dict[str, Hardware] = {
    h.name: h
    for h in [
        _gpu("h100-sxm", "NVIDIA H100 SXM5 80GB", 3350, {"fp32": 67, "tf32": 494.5, "bf16": 989.5,
             "fp16": 989.5, "fp8": 1979}, 80, 3.00,
             "NVIDIA H100 Tensor Core GPU datasheet (SXM column; sparse figures halved)"),
        _gpu("h100-pcie", "NVIDIA H100 PCIe 80GB", 2000, {"fp32": 51, "tf32": 378, "bf16": 756,
             "fp16": 756, "fp8": 1513}, 80, 2.50,
             "NVIDIA H100 Tensor Core GPU datasheet (PCIe column; sparse figures halved)"),
        _gpu("h200", "NVIDIA H200 SXM 141GB", 4800, {"fp32": 67, "tf32": 494.5, "bf16": 989.5,
             "fp16": 989.5, "fp8": 1979}, 141, 3.80,
             "NVIDIA H200 Tensor Core GPU datasheet (SXM column; sparse figures halved)"),
        _gpu("a100-40gb", "NVIDIA A100 SXM4 40GB", 1555, {"fp32": 19.5, "tf32": 156, "bf16": 312,
             "fp16": 312, "int8": 624}, 40, 1.30,
             "NVIDIA A100 Tensor Core GPU datasheet (40GB SXM; dense figures)"),
        _gpu("a100-80gb", "NVIDIA A100 SXM4 80GB", 2039, {"fp32": 19.5, "tf32": 156, "bf16": 312,
             "fp16": 312, "int8": 624}, 80, 1.80,
             "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM; dense figures)"),
        _gpu("l4", "NVIDIA L4 24GB", 300, {"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121,
             "fp8": 242.5}, 24, 0.80,
             "NVIDIA L4 Tensor Core GPU datasheet (sparse figures halved)"),
        _gpu("l40s", "NVIDIA L40S 48GB", 864, {"fp32": 91.6, "tf32": 183, "bf16": 362,
             "fp16": 362, "fp8": 733}, 48, 1.50,
             "NVIDIA L40S datasheet (sparse figures halved)"),
        _gpu("a10g", "NVIDIA A10G 24GB (AWS g5)", 600, {"fp32": 31.2, "tf32": 62.5, "bf16": 125,
             "fp16": 125}, 24, 1.00,
             "NVIDIA A10 datasheet (A10G is AWS's A10 variant with no separate datasheet; "
             "its clocks may be lower)"),
        _gpu("mi300x", "AMD Instinct MI300X 192GB", 5300, {"fp32": 163.4, "tf32": 653.7,
             "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9}, 192, 4.00,
             "AMD Instinct MI300X data sheet (dense figures)"),
        _gpu("b200", "NVIDIA B200 180GB (HGX)", 7700, {"fp32": 75, "tf32": 1100, "bf16": 2250,
             "fp16": 2250, "fp8": 4500}, 180, 6.00,
             "NVIDIA HGX B200 datasheet, 8-GPU totals divided by 8 (sparse figures halved)"),
        _gpu("rtx-4090", "NVIDIA GeForce RTX 4090 24GB", 1008, {"fp32": 82.6, "bf16": 165.2,
             "fp16": 165.2, "fp8": 330.3}, 24, 0.40,
             "NVIDIA Ada Lovelace architecture whitepaper, appendix (FP32 accumulate, dense)"),
    ]
}

ALIASES = {"h100": "h100-sxm", "h100-sxm5": "h100-sxm", "a100": "a100-80gb", "mi300": "mi300x",
           "4090": "rtx-4090", "rtx4090": "rtx-4090", "h200-sxm": "h200"}

CPU_COST_PER_HOUR = 0.10  # a small on-demand cloud VM; override with --cost-per-hour


def known_hardware() -> list[str]:
    return [*CATALOG, "cpu"]


def get_hardware(name: str, remeasure: bool = False) -> Hardware:
    """A catalog entry, or this CPU measured (`remeasure`: again, not from the cache);
    KeyError naming the problem."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key == "cpu":
        return measure_cpu(refresh=remeasure)
    if key not in CATALOG:
        raise KeyError(f"unknown hardware {name!r}; known: {', '.join(known_hardware())}")
    if remeasure:
        raise KeyError(f"--remeasure takes this CPU's measurement again (--hardware cpu); "
                       f"{name} is a datasheet entry, nothing is measured for it")
    return CATALOG[key]


# ---- measured CPU ------------------------------------------------------------------------


def _cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def _memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GB


def cpu_cache_path() -> Path:
    return cache_dir() / "cpu_roofline.json"


def cpu_cache_key(threads: int, torch_version: str) -> str:
    """Figures are reused only on the same CPU model, thread count and torch version (and
    the same micro-benchmark: `v2` reads buffers >= 4x the last-level cache, `v3` adds
    the integer kernels' rates, `v4` the instruction ceilings)."""
    return f"{_cpu_model()}|threads={threads}|torch={torch_version}|v4"


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache sysfs lists (the L3 on x86), or None where none is listed."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper() if path.exists() else ""
        m = re.fullmatch(r"(\d+)([KMG]?)", text)
        if m:
            sizes.append(int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)])
    return max(sizes) if sizes else None


def measure_cpu(refresh: bool = False) -> Hardware:
    """This machine's memory read bandwidth and matmul rate per dtype, cached per CPU/threads.

    The bandwidth is the median of several streaming reads of a buffer >= 4x the
    last-level cache (so no try reads from cache), with the spread of the tries beside it;
    the matmul rate is the best of a few 1024² matmuls (a peak); the integer rates are
    the engine's own GGUF kernels' on weights held in cache (`_int_kernel_flops`).
    Only a steady measurement is cached (`steady_measurement`); `refresh` (the CLI's
    --remeasure) measures again. A cached one whose reads spread too wide (written
    before that rule) is measured again too.
    """
    import torch  # lazy: only --hardware cpu pays for it

    threads = torch.get_num_threads()
    key = cpu_cache_key(threads, torch.__version__)
    path = cpu_cache_path()
    cached = {}
    if path.exists():
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = {}
    figures = cached.get(key)
    if refresh or figures is None or not is_steady(figures):
        figures = steady_measurement(torch)
        if is_steady(figures):
            cached[key] = figures
        else:  # this run only; nor is an unsteady older entry kept
            cached.pop(key, None)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cached, indent=2))
        except OSError:
            pass  # a read-only home still gets the figures, just not cached
    when = _measured_at(figures)
    return Hardware(
        name="cpu",
        description=f"{_cpu_model()}, {threads} torch threads (measured)",
        # the best streaming read (a floor is a bound: the median of a contended machine's
        # tries is beaten by a step that ran in a quiet second); not a copy: decode reads
        memory_bandwidth_bytes_s=max(figures.get("read_bandwidth_tries_bytes_s")
                                     or [figures["read_bandwidth_bytes_s"]]),
        peak_flops=cpu_peak_flops(figures["matmul_flops"], figures.get("int_matmul_flops"),
                                  (figures.get("instruction_ceiling") or {}).get("flops")),
        memory_bytes=_memory_bytes(),
        cost_per_hour=CPU_COST_PER_HOUR,
        source=(f"micro-benchmark on this machine{when}, cached in {path}"
                if is_steady(figures) else
                f"micro-benchmark on this machine{when}, under load: not cached (the next "
                "run measures again)"),
        measured=figures,
    )


# A measurement is steady when its streaming-read tries spread no wider than this
# (max / min). The tries run back to back in about a second, so on a quiet machine they
# agree: 29.5-30.4 GB/s (1.03) and 25.2-27.2 (1.08) here. A machine busy with other
# work gave 5.2-13.3 (2.56) and 0.9-2.1 (2.3): that figure, cached, made explain call
# a step "135% of its floor" for days. 1.25 leaves a quiet machine's jitter 3x room.
STEADY_SPREAD = 1.25
READ_ATTEMPTS = 3  # read tries taken at most: with the rest of the figures, then alone
READ_PAUSE_S = 1.0  # between attempts: a passing burst of load may be over


def read_spread(figures: dict) -> float | None:
    """max / min of the streaming-read tries; None where none were kept (older caches)."""
    tries = figures.get("read_bandwidth_tries_bytes_s")
    return max(tries) / min(tries) if tries and min(tries) > 0 else None


def is_steady(figures: dict) -> bool:
    spread = read_spread(figures)
    return spread is None or spread <= STEADY_SPREAD


def steady_measurement(torch) -> dict:
    """The micro-benchmark; where its reads spread wider than STEADY_SPREAD the reads
    alone are taken again (the whole took 131 s on a loaded 2-core VM, the reads 4 s),
    up to READ_ATTEMPTS in all: the first steady attempt is kept, else the one with the
    best read (the floor is a bound) and `under_load` set, which measure_cpu does not
    cache. The other figures are peaks (best of their tries), which a passing load
    lowers less than it spreads the reads."""
    figures = _micro_benchmark(torch)
    attempts = [figures["read_bandwidth_tries_bytes_s"]]
    while not is_steady(figures) and len(attempts) < READ_ATTEMPTS:
        time.sleep(READ_PAUSE_S)
        attempts.append(read_bandwidth_tries(torch)[1])
        best = next((t for t in attempts if is_steady(_reads(t))),
                    max(attempts, key=max))
        figures = {**figures, **_reads(best)}
    if len(attempts) > 1:
        figures["read_attempts_gb_s"] = [[round(min(t) / GB, 2), round(max(t) / GB, 2)]
                                         for t in attempts]
    if not is_steady(figures):
        figures["under_load"] = True
    return figures


def _reads(tries: list[float]) -> dict:
    return {"read_bandwidth_bytes_s": statistics.median(tries),
            "read_bandwidth_tries_bytes_s": sorted(tries)}


def _measured_at(figures: dict) -> str:
    """", measured 2026-12-06 11:48" (local time), or "" where the figures lack it."""
    stamp = figures.get("measured_at")
    return f", measured {stamp.replace('T', ' ')[:16]}" if stamp else ""


def cpu_peak_flops(matmul_flops: dict[str, float],
                   int_flops: dict[str, float] | None = None,
                   ceilings: dict[str, float] | None = None) -> dict[str, float]:
    """The CPU's peak per compute dtype from its measured matmul rates. Without native
    bf16 arithmetic (an AVX2 machine: torch's bf16 matmul ran at 0.85 GFLOP/s there,
    fp32 at 119) bf16 weights are multiplied in fp32, so bf16's peak is never below
    fp32's: the floor is what the hardware allows, not what one library's bf16 kernel
    did. The integer activations of gguf-a16 / gguf-a8 (int16, int8) run the engine's
    integer kernel up to a batch and may hand larger ones to the bf16 weights (on
    AVX512 CPUs from 20 rows), so their peak is the faster of that kernel's and bf16's;
    where the kernel was not measured they read bf16's (Hardware.peak_dtype)."""
    fp32 = matmul_flops["fp32"]
    peaks = {"fp32": fp32, "bf16": max(matmul_flops["bf16"], fp32)}
    for dtype, rate in (int_flops or {}).items():
        peaks[dtype] = max(rate, peaks["bf16"])
    # the instruction ceiling (ceiling.py) bounds every kernel: a floor must, so each
    # peak is at least it; the measured kernels stay where they are higher (they are not)
    for dtype, rate in (ceilings or {}).items():
        peaks[dtype] = max(rate, peaks.get(dtype, 0.0), peaks["bf16"] if dtype.startswith(
            "int") else 0.0)
    return peaks


def bandwidth_basis(hw: Hardware) -> str:
    """Which figure the floor's bandwidth is: said in explain's and roofline's output."""
    m = hw.measured
    if "bandwidth overridden" in hw.source:
        return "--bandwidth"
    if hw.name != "cpu" or "read_bandwidth_bytes_s" not in m:
        return "datasheet"
    tries = m.get("read_bandwidth_tries_bytes_s")
    when = _measured_at(m)
    if not tries:
        return f"best of a few 64 MiB reads (an older cached measurement{when})"
    spread = f"{min(tries) / GB:.1f}–{max(tries) / GB:.1f} GB/s"
    if not is_steady(m):
        return (f"measured under load: tries spread {spread}; not cached{when}; a floor "
                "from it is too slow: measure on a quiet machine (--remeasure)")
    buf = m.get("buffer_bytes", 0) / 2**20
    return f"best of {len(tries)} streaming reads of {buf:,.0f} MiB, spread {spread}{when}"


def _best_time(fn, reps: int, budget_s: float = 1.0) -> float:
    """The fastest of `reps` timed calls after a warm-up, fewer (at least one) once the
    timed calls took `budget_s` (torch's emulated bf16 matmul takes 2 s a call on AVX2)."""
    fn()  # warm-up: page faults, thread pool start, kernel selection
    best, spent = float("inf"), 0.0
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent >= budget_s:
            break
    return best


def _times(fn, reps: int) -> list[float]:
    fn()  # warm-up: page faults, thread pool start
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


READ_TRIES = 5
MIN_BUFFER_BYTES = 256 * 2**20


def read_bandwidth_tries(torch, tries: int = READ_TRIES) -> tuple[object, list[float]]:
    """Streaming reads of a buffer >= 4x the last-level cache (so no try reads from
    cache), summed by torch on its threads: (the buffer, each try's bytes/s, sorted)."""
    buffer_bytes = max(MIN_BUFFER_BYTES, 4 * (last_level_cache_bytes() or 0))
    src = torch.ones(buffer_bytes // 4, dtype=torch.float32)
    return src, sorted(buffer_bytes / t for t in _times(lambda: src.sum(), reps=tries))


def _micro_benchmark(torch) -> dict:
    llc = last_level_cache_bytes()
    # the integer kernels' rates before and after the rest, the faster kept: a shared VM
    # slows for a second or so at a time, and the cached figure outlives it
    int_first = _int_kernel_flops(torch)[0]
    src, read = read_bandwidth_tries(torch)
    n = src.numel()
    buffer_bytes = 4 * n
    dst = torch.empty_like(src)
    copy = sorted(2 * 4.0 * n / t for t in _times(lambda: dst.copy_(src), reps=2))
    matmul = {}
    size = 1024
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        matmul[name] = 2.0 * size**3 / _best_time(lambda a=a, b=b: torch.mm(a, b), reps=3)
    int_flops, int_kernel = _int_kernel_flops(torch)
    int_flops = {k: max(v, int_first.get(k, 0.0)) for k, v in int_flops.items()}
    from tokenmill.roofline.ceiling import measure_instruction_ceilings

    return {
        "instruction_ceiling": measure_instruction_ceilings(torch.get_num_threads()),
        "int_matmul_flops": int_flops,
        "int_matmul_kernel": int_kernel,
        "read_bandwidth_bytes_s": statistics.median(read),
        "read_bandwidth_tries_bytes_s": read,
        "copy_bandwidth_bytes_s": statistics.median(copy),  # read + write, for reference
        "buffer_bytes": buffer_bytes,
        "last_level_cache_bytes": llc,
        "matmul_flops": matmul,
        "matmul_shape": [size, size, size],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


# K, N of the integer kernels' weight: a SmolLM2-135M MLP projection's shape, whose Q4
# records (553 KB) the two cores' L2 caches hold, as torch's 1024² matmuls are a peak
INT_SHAPE = (576, 1536)
INT_ROWS = 16  # rows of the per-row kernel's call (gguf-a16 / gguf-a8 below 20 rows)
GEMM16_ROWS = 128  # rows of AVX2's gemm16 call (gguf-a16's prompts and large batches)


def _int_kernel_flops(torch) -> tuple[dict[str, float], str | None]:
    """The rates of the engine's gguf-a16 (int16) and gguf-a8 (int8) activations: its
    integer kernel (tokenmill/kernels/q4q8_gemv.c) on Q4 records held in cache, 2
    multiply-adds counted as 2 FLOPs; int16 on AVX2 is also AVX2's gemm16 at many rows
    (the faster counts). ({}, why) where the kernel is not built or has no SIMD dot
    products: those dtypes then read bf16's peak."""
    try:
        from tokenmill.kernels import q4q8_gemv
        from tokenmill.quant import vnni
        from tokenmill.quant.codes import int4_codes_from_float
    except ImportError as e:  # pragma: no cover - part of the package
        return {}, f"not measured: {e}"
    isa = q4q8_gemv.isa()
    if isa not in ("avx2", "avx512-vnni"):
        return {}, f"not measured: the integer kernel is {isa or 'not built'} here"
    k, n = INT_SHAPE
    gen = torch.Generator().manual_seed(0)
    codes, scale, zero = int4_codes_from_float(torch.randn(n, k, generator=gen))
    records, fmt = vnni.repack(codes, scale, zero, 1)

    def rate(rows: int, call) -> float:
        x = torch.randn(rows, k, generator=gen).bfloat16()
        if call(x) is None:  # the kernel did not take it: no figure rather than a wrong one
            return 0.0
        return 2.0 * rows * k * n / _best_time(lambda: call(x), reps=30)

    rates = {bits_name: rate(INT_ROWS, lambda x, bits=bits: q4q8_gemv.linear(
                 x, records, n, fmt, bits=bits))
             for bits_name, bits in (("int8", 8), ("int16", 16))}
    what = f"q4q8_gemv ({isa}), Q4 {n}×{k} in cache: {INT_ROWS} rows"
    if isa == "avx2":
        rates["int16"] = max(rates["int16"], rate(
            GEMM16_ROWS, lambda x: q4q8_gemv.gemm16(x, records, n, fmt)))
        what += f", gemm16 at {GEMM16_ROWS} rows"
    return {name: r for name, r in rates.items() if r > 0}, what
