"""Resident memory beside speed: this process's peak RSS over one measured span.

Linux keeps a process's peak resident set (VmHWM); writing "5" to /proc/self/clear_refs
resets it, so the peak of a span is read without counting what came before it (the
bandwidth probe's buffers, an earlier configuration). A child's peak comes from
os.wait4's rusage (peers/offline.py).
"""

from __future__ import annotations

from pathlib import Path


def reset_peak() -> bool:
    """Start a new peak; False where the kernel does not allow it (the peak then covers
    the whole process so far)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_mib() -> float | None:
    """Peak resident memory since reset_peak() (MiB), or None off Linux."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib / 1024


def rss_mib() -> float | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib / 1024
