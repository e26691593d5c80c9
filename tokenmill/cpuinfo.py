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
