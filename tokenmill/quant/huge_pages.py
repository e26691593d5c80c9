"""The quantized-activation kernel's weights side by side in transparent huge pages.

A decode step streams every packed weight (~100 MB for SmolLM2-135M) from memory. In
4 KiB pages that is ~25,000 TLB misses a step, and the hardware prefetchers stop at
every page boundary; where those tensors land (heap or a mapping of its own) decides
how often, so the same kernel ran one step's linears at 16 rows in 8.6 or 12.2 ms
depending on what the process had allocated before (BENCHMARKS.md, "Huge pages").
One private anonymous mapping, 2 MiB aligned and advised MADV_HUGEPAGE (which Linux
honours under transparent_hugepage `madvise` or `always`), holds them all instead.
Private, not Python's default MAP_SHARED: a shared anonymous mapping is shmem, whose
huge pages follow `shmem_enabled` (`never` by default), so the advice was ignored
and a ~1B model's 698 MiB of records sat in 4 KiB pages (issue 56).
TOKENMILL_HUGE_PAGES=0 keeps each tensor where it was allocated (for A/B runs).
"""

from __future__ import annotations

import bisect
import mmap
import os
import re

import torch

from tokenmill import malloc

HUGE_PAGE = 2 << 20
TRIM_EVERY_BYTES = 64 << 20
ALIGN = 64  # each tensor starts on a cache line
# the weight report reads smaps (~20-50 ms: the kernel walks every mapping) only for
# records this large, where 4 KiB pages cost the most and a load takes seconds anyway
REPORT_MIN_BYTES = 256 << 20
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ", re.MULTILINE)  # smaps' mapping lines
_HUGE = re.compile(r"^AnonHugePages:\s+(\d+) kB", re.MULTILINE)


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Copies of `tensors` (CPU, contiguous) side by side in one mapping as `move_into`
    makes it; None where the platform has no such advice."""
    slots = [_Slot(t) for t in tensors]
    return [s.tensor for s in slots] if move_into([(s, "tensor") for s in slots]) else None


class _Slot:
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def move_into(holders: list[tuple[object, str]]) -> bool:
    """Move each `getattr(obj, attr)` tensor (CPU, contiguous) of `holders` into one
    anonymous mapping advised MADV_HUGEPAGE, side by side from a 2 MiB boundary, and
    set the attribute to the copy (the copies hold the mapping). One at a time: each
    original is released as soon as its copy is made, so the move costs one tensor's
    bytes at its peak, not all of them twice (a ~1B model's records are 840 MB).
    False where the platform has no such advice (the tensors stay where they were)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not holders or os.environ.get("TOKENMILL_HUGE_PAGES", "1") in (
            "0", "false", "no", "off"):
        return False
    sizes = [_nbytes(getattr(obj, attr)) for obj, attr in holders]
    total = sum(-(-s // ALIGN) * ALIGN for s in sizes)
    pages = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        pages.madvise(advice)
    except OSError:  # a kernel without transparent huge pages
        return False
    arena = torch.frombuffer(pages, dtype=torch.uint8)
    at = -arena.data_ptr() % HUGE_PAGE
    freed = 0
    for (obj, attr), size in zip(holders, sizes, strict=True):
        t = getattr(obj, attr)
        dst = arena[at:at + size]
        dst.copy_(t.contiguous().view(-1).view(torch.uint8))
        setattr(obj, attr, dst.view(t.dtype).view(t.shape))
        del t
        at += -(-size // ALIGN) * ALIGN
        freed += size
        if freed >= TRIM_EVERY_BYTES:  # originals freed inside the heap stay resident
            malloc.trim()  # until trimmed: without this the move held both copies
            freed = 0
    return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()



def huge_page_bytes(tensors: list[torch.Tensor]) -> int | None:
    """Bytes of transparent huge pages (smaps' AnonHugePages) in the mappings that hold
    `tensors` (CPU), each mapping counted once: what the kernel actually gave, which the
    advice alone does not decide (the system's THP settings, free contiguous memory).
    None where /proc/self/smaps cannot be read (not Linux)."""
    starts = sorted({t.data_ptr() for t in tensors if t.device.type == "cpu" and t.numel()})
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return None
    total = 0
    for m in _MAPPING.finditer(text):  # one regex pass: torch's process has ~1,000 mappings
        i = bisect.bisect_left(starts, int(m[1], 16))  # the first start at or past lo
        if i < len(starts) and starts[i] < int(m[2], 16):
            found = _HUGE.search(text, m.end())
            total += int(found[1]) * 1024 if found else 0
    return total
