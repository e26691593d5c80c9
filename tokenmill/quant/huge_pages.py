"""The quantized-activation kernel's weights side by side in transparent huge pages.

A decode step streams every packed weight (~100 MB for SmolLM2-135M) from memory. In
4 KiB pages that is ~25,000 TLB misses a step, and the hardware prefetchers stop at
every page boundary; where those tensors land (heap or a mapping of its own) decides
how often, so the same kernel ran one step's linears at 16 rows in 8.6 or 12.2 ms
depending on what the process had allocated before (BENCHMARKS.md, "Huge pages").
One anonymous mapping, 2 MiB aligned and advised MADV_HUGEPAGE (which Linux honours
under transparent_hugepage `madvise` or `always`), holds them all instead.
TOKENMILL_HUGE_PAGES=0 keeps each tensor where it was allocated (for A/B runs).
"""

from __future__ import annotations

import mmap
import os

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Copies of `tensors` (CPU, contiguous) side by side in one anonymous mapping
    advised MADV_HUGEPAGE, starting on a 2 MiB boundary; the copies hold the mapping.
    None where the platform has no such advice (the caller keeps its tensors)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not tensors or os.environ.get("TOKENMILL_HUGE_PAGES", "1") in (
            "0", "false", "no", "off"):
        return None
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(-(-s // ALIGN) * ALIGN for s in sizes)
    pages = mmap.mmap(-1, total + HUGE_PAGE)
    try:
        pages.madvise(advice)
    except OSError:  # a kernel without transparent huge pages
        return None
    arena = torch.frombuffer(pages, dtype=torch.uint8)
    at = -arena.data_ptr() % HUGE_PAGE
    copies = []
    for t, size in zip(tensors, sizes, strict=True):
        dst = arena[at:at + size]
        dst.copy_(t.contiguous().view(-1).view(torch.uint8))
        copies.append(dst.view(t.dtype).view(t.shape))
        at += -(-size // ALIGN) * ALIGN
    return copies
