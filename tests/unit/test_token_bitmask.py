"""The native token-bitmask kernel against the unpacked mask, on the masks a grammar
makes (whole words allowed or banned, and mixed ones), a vocabulary that is not a
multiple of 32, and a subset of the batch's rows."""

import pytest
import torch

from tokenmill.kernels import token_bitmask
from tokenmill.structured.logits import _allowed


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """(N, V) bool -> xgrammar's (N, ceil(V/32)) int32 words."""
    n, v = allowed.shape
    padded = torch.zeros(n, -(-v // 32) * 32, dtype=torch.int64)
    padded[:, :v] = allowed.long()
    words = (padded.view(n, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("vocab", [49152, 49155, 100])
@pytest.mark.parametrize("density", [0.0, 0.002, 0.5, 0.998, 1.0])
def test_only_the_listed_rows_lose_exactly_their_disallowed_tokens(vocab, density):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    allowed = torch.rand(5, vocab, generator=gen) < density
    allowed[:, :64] = True  # a run of whole allowed words, then the mix
    allowed[:, 64:96] = False  # and a whole banned word
    mask = _pack(allowed)
    assert torch.equal(_allowed(mask, vocab), allowed)  # the packing is xgrammar's
    rows = [0, 3, 4]
    out = logits.clone()
    if not token_bitmask.apply_(out, mask, rows):
        pytest.skip("the native kernels are not built here (no compiler)")
    expected = logits.clone()
    expected[rows] = expected[rows].masked_fill(~allowed[rows], float("-inf"))
    assert torch.equal(out, expected)


def test_tensors_it_does_not_take_are_left_to_the_caller():
    logits = torch.randn(2, 64, dtype=torch.bfloat16)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    assert token_bitmask.apply_(logits, mask, [0]) is False
    assert torch.isfinite(logits.float()).all()
