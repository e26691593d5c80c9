"""The C heap (glibc's malloc), seen and trimmed from Python through ctypes.

`trim()` hands the arenas' whole free pages back to the OS (malloc_trim(0));
`heap_stats()` reads mallinfo2: what the arenas hold, in use and free, and what
lives in mappings of its own; `set_mmap_threshold()` fixes the size from which an
allocation gets its own mapping (mallopt). Where the C library is not glibc they are
no-ops (None / False).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass
from typing import Any


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def _function(name: str) -> Any:
    libc = _libc()
    fn = getattr(libc, name, None) if libc is not None else None
    if fn is not None and name == "malloc_trim":
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    if fn is not None and name == "mallopt":
        fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if fn is not None and name == "mallinfo2":
        fn.argtypes, fn.restype = [], _MallInfo2
    return fn


def trim_available() -> bool:
    return _function("malloc_trim") is not None


def trim(pad: int = 0) -> bool:
    """malloc_trim(pad): keep `pad` bytes at the heap's top; True when there was one
    to call."""
    fn = _function("malloc_trim")
    if fn is None:
        return False
    fn(pad)
    return True


@dataclass(frozen=True)
class HeapStats:
    arena_bytes: int  # the main and thread arenas' size (brk and arena mappings)
    in_use_bytes: int  # allocated from the arenas
    free_bytes: int  # free inside the arenas: RSS until reused or trimmed
    mmapped_bytes: int  # allocations above the mmap threshold, each its own mapping


M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2)


def set_mmap_threshold(nbytes: int) -> bool:
    """mallopt(M_MMAP_THRESHOLD, nbytes): allocations of at least `nbytes` get their
    own mapping, returned to the OS when freed, and glibc stops raising the threshold
    as large blocks are freed (its dynamic default); True when it took effect."""
    if not 0 < nbytes <= MMAP_THRESHOLD_MAX:
        raise ValueError(f"an mmap threshold must be 1..{MMAP_THRESHOLD_MAX} bytes, not {nbytes}")
    fn = _function("mallopt")
    return fn is not None and fn(M_MMAP_THRESHOLD, nbytes) == 1


def heap_stats() -> HeapStats | None:
    """mallinfo2 (glibc 2.33+); None where there is none."""
    fn = _function("mallinfo2")
    if fn is None:
        return None
    m = fn()
    return HeapStats(int(m.arena), int(m.uordblks), int(m.fordblks), int(m.hblkhd))
