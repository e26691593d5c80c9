"""The packed large-batch matmul runs at bucketed row counts (quant/dense.py): a
server's prefills of every length reuse a few dozen compiled oneDNN shapes, and the
padding changes no real row's output."""

from __future__ import annotations

import pytest
import torch

from tokenmill.quant.dense import DenseWeight, bucket_rows


def test_buckets_are_few_and_never_below_the_rows():
    rows = range(1, 2049)
    assert all(m <= bucket_rows(m) < m + (8 if m <= 64 else 16 if m <= 512 else 64)
               for m in rows)
    assert len({bucket_rows(m) for m in range(20, 257)}) == 18  # a server's steps
    assert len({bucket_rows(m) for m in rows}) == 60


@pytest.mark.parametrize("m", [20, 37, 64, 65, 200, 513, 700])
def test_padded_rows_leave_the_real_rows_as_the_plain_matmul(m):
    weight = torch.randn(384, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    dense = DenseWeight(weight)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
    y = dense(x)
    assert y.shape == (m, 384) and y.is_contiguous()
    ref = x.float() @ weight.to(dense.dtype).float().T
    torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=0.02)
    if dense.packed is not None:  # as the exact shape's own primitive
        exact = torch.ops.mkldnn._linear_pointwise(x.to(dense.dtype), dense.packed, None,
                                                   "none", [], "").to(y.dtype)
        if dense.dtype == torch.bfloat16:  # native bf16: the same bits
            assert torch.equal(y, exact)
        else:  # the fp32 copy of CPUs without bf16 (not timed or bit-checked on AVX2 yet)
            torch.testing.assert_close(y, exact, atol=1e-2, rtol=1e-2)
