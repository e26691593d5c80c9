"""The triton backend's contract without running kernels: availability, the KV
layout, the per-step plan, and that `import tokenmill` never imports triton."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tokenmill.attention.base import BackendUnavailable
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.triton import TritonBackend
from tokenmill.attention.triton.plan import (
    DECODE_BLOCK_N,
    MAX_SPLITS,
    PREFILL_BLOCK_M,
    build_plan,
    choose_splits,
)

CPU = torch.device("cpu")


def test_cpu_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in TritonBackend.unavailable_reason(CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonBackend.unavailable_reason(CPU) is None


def test_kv_layout_and_dtypes():
    backend = TritonBackend(CPU, torch.float32)
    assert backend.kv_cache_shape(10, 16, 3, 64) == (10, 16, 3, 64)
    assert backend.block_dim == 0 and not backend.needs_zeroed_blocks
    with pytest.raises(BackendUnavailable, match="head_dim"):
        backend.kv_cache_shape(10, 16, 3, 96)
    with pytest.raises(BackendUnavailable, match="torch backend"):
        TritonBackend(CPU, torch.bfloat16)  # bf16 dots are wrong under the interpreter


def _meta(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64), query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros(len(seq_lens), 8, dtype=torch.int32), block_size=16,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_list=query_lens, seq_lens_list=seq_lens)


def test_plan_splits_decodes_from_prefill_tiles():
    plan = build_plan(_meta([1, 130, 1, 64], [900, 130, 40, 100]), CPU, num_sms=132)
    assert plan.decode_seqs.tolist() == [0, 2]
    tiles = list(zip(plan.tile_seqs.tolist(), plan.tile_starts.tolist()))
    assert tiles == [(1, 0), (1, PREFILL_BLOCK_M), (1, 2 * PREFILL_BLOCK_M), (3, 0)]
    # two decodes cannot fill 132 SMs: split the longest (900 keys, 15 tiles) into at
    # most 14 splits of whole tiles: 8 of 2 tiles
    assert plan.split_len == 2 * DECODE_BLOCK_N and plan.num_splits == 8


def test_split_choice():
    assert choose_splits(0, 0, 132) == 1
    assert choose_splits(256, 4096, 132) == 1  # enough decodes to fill the machine
    assert choose_splits(1, 100, 132) == 1  # too short to split
    assert choose_splits(1, 32768, 132) == MAX_SPLITS
    forced = build_plan(_meta([1], [100]), CPU, num_sms=132, num_splits=4)
    assert forced.num_splits == 2  # no split starts past the sequence (100 = 64 + 36)


def test_import_tokenmill_does_not_import_triton():
    code = ("import sys, tokenmill, tokenmill.attention, tokenmill.attention.triton; "
            "from tokenmill.attention import available_backends; "
            "import torch; available_backends(torch.device('cpu')); "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_plan_lists_are_16_byte_aligned():
    # the compiled variants assume aligned pointers (tt.divisibility 16)
    plan = build_plan(_meta([1, 3, 1, 70, 1], [9, 3, 5, 80, 6]), CPU, num_sms=8)
    for t in (plan.decode_seqs, plan.tile_seqs, plan.tile_starts):
        assert t.data_ptr() % 16 == 0
    assert plan.decode_seqs.tolist() == [0, 2, 4]
    assert plan.tile_seqs.tolist() == [1, 3, 3] and plan.tile_starts.tolist() == [0, 0, 64]
