"""The weights load on one torch thread (engine/runner/weights.py, issue 60): the
engine's thread count is back afterwards, and a bf16 weight packed for oneDNN on one
thread multiplies exactly as one packed on the engine's threads."""

from __future__ import annotations

import torch

from tokenmill.engine.runner.weights import _one_thread
from tokenmill.quant.dense import DenseWeight


def test_thread_count_restored_even_on_error():
    before = torch.get_num_threads()
    try:
        with _one_thread(torch.device("cpu")):
            assert torch.get_num_threads() == 1
            raise RuntimeError("a bad file")
    except RuntimeError:
        pass
    assert torch.get_num_threads() == before


def test_packed_on_one_thread_multiplies_the_same():
    torch.manual_seed(0)
    w = torch.randn(1536, 576).bfloat16()
    x = torch.randn(40, 576).bfloat16()  # a large batch: the dense path's rows
    reference = DenseWeight(w)(x)
    with _one_thread(torch.device("cpu")):
        packed = DenseWeight(w)
    assert torch.equal(packed(x), reference)
