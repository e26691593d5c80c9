"""Fields of /proc/cpuinfo (Linux), read once per process."""

from __future__ import annotations

import functools


@functools.cache
def cpuinfo_field(name: str) -> str | None:
    """The first value of `name` ("flags", "model name", ...); None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    return set((cpuinfo_field("flags") or "").split())


def has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (oneDNN), not emulated in fp32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
