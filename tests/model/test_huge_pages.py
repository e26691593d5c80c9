"""The kernel's packed weights live in one huge-page mapping (quant/huge_pages.py)."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from tokenmill.quant import huge_pages

needs_advice = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"),
                                  reason="no MADV_HUGEPAGE on this platform")


@needs_advice
def test_gather_copies_side_by_side_from_a_huge_page_boundary():
    tensors = [torch.arange(1000, dtype=torch.uint8), torch.randn(3, 77),
               torch.randint(0, 9, (5, 320), dtype=torch.uint8)]
    copies = huge_pages.gather(tensors)
    assert copies is not None
    assert copies[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    for t, c in zip(tensors, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
        assert c.data_ptr() % huge_pages.ALIGN == 0
    # side by side: each starts where the last ended, rounded up to a cache line
    assert copies[1].data_ptr() - copies[0].data_ptr() == 1024
    expected = [t.clone() for t in tensors]
    del tensors  # the copies hold the mapping, not the originals
    assert all(torch.equal(c, e) for c, e in zip(copies, expected, strict=True))


def test_off_by_env(monkeypatch):
    monkeypatch.setenv("TOKENMILL_HUGE_PAGES", "0")
    assert huge_pages.gather([torch.zeros(4)]) is None


@needs_advice
def test_a_quantized_model_runs_its_kernel_on_the_gathered_records():
    from tests.engine.conftest import small_engine
    engine = small_engine(quantization="gguf-a16")
    packed = [m.vnni_packed for m in engine.runner.model.modules()
              if isinstance(getattr(m, "vnni_packed", None), torch.Tensor)]
    assert len(packed) == 30 * 4 + 1  # four linears a layer and the LM head
    starts = sorted(t.data_ptr() for t in packed)
    assert starts[0] % huge_pages.HUGE_PAGE == 0
    total = sum(t.numel() * t.element_size() for t in packed)
    assert starts[-1] - starts[0] < total  # one mapping, not 121 allocations


def _thp_setting(name: str) -> str | None:
    """The bracketed choice of /sys/kernel/mm/transparent_hugepage/NAME, None without."""
    try:
        text = (Path("/sys/kernel/mm/transparent_hugepage") / name).read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


# where a fault in an advised region gets a huge page at once (direct compaction):
# enabled `always` / `madvise` and defrag that compacts for advised regions
needs_thp = pytest.mark.skipif(
    _thp_setting("enabled") not in ("always", "madvise")
    or _thp_setting("defrag") not in ("always", "madvise", "defer+madvise"),
    reason="transparent huge pages not given to advised regions at fault here")


@needs_thp
def test_records_land_on_huge_pages(monkeypatch):
    """Issue 56: the records sat in a MAP_SHARED mapping (Python's default), which is
    shmem, whose huge pages follow shmem_enabled (`never` by default): the advice was
    ignored and a ~1B model's 698 MiB streamed through 4 KiB pages. The start-up line
    and /server_info say how much the OS gave (weight_report)."""
    from tests.engine.conftest import small_engine
    monkeypatch.setattr(huge_pages, "REPORT_MIN_BYTES", 0)  # reported from 256 MiB
    engine = small_engine(quantization="gguf-a16")
    forms = engine.runner.model.weight_forms
    records = forms["lowbit_bytes"]
    assert records > 32 << 20
    # the part of the records in whole 2 MiB pages (the arena's last page is partial);
    # a little slack for a fault that found no free huge page
    assert forms["records_huge_page_bytes"] >= 0.8 * (records - huge_pages.HUGE_PAGE)



@needs_thp
def test_huge_page_bytes_counts_the_mapping_holding_the_tensors_once():
    copies = huge_pages.gather([torch.ones(8 << 20, dtype=torch.uint8)])
    assert copies is not None
    one = huge_pages.huge_page_bytes(copies)
    assert 6 << 20 <= one <= 10 << 20  # 8 MiB from a 2 MiB boundary, in a 10 MiB mapping
    assert huge_pages.huge_page_bytes([copies[0], copies[0][4096:], copies[0]]) == one
    assert huge_pages.huge_page_bytes([]) == 0
