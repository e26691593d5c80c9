"""The kernel's packed weights live in one huge-page mapping (quant/huge_pages.py)."""

from __future__ import annotations

import mmap

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
