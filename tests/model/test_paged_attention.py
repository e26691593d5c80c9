"""The paged KV cache path gives the same logits as recomputing everything without a cache:
two sequences in one flat batch, prefill in two chunks, mixed steps, then decode steps."""

from __future__ import annotations

import pytest
import torch

from tokenmill.attention import get_backend
from tokenmill.attention.metadata import AttentionMetadata, attention_metadata
from tokenmill.kvcache.pool import KVPool
from tokenmill.loaders import load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 24


def _metadata(steps: list[tuple[list[int], int]], block_tables: list[list[int]]):
    """steps: per sequence (positions fed this step, seq_len after the step)."""
    slots, query_lens, seq_lens = [], [], []
    for b, (positions, seq_len) in enumerate(steps):
        slots += [block_tables[b][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                  for p in positions]
        query_lens.append(len(positions))
        seq_lens.append(seq_len)
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        block_size=BLOCK_SIZE, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_list=query_lens, seq_lens_list=seq_lens)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_paged_cache_matches_no_cache(hf_checkpoint, arch):
    path, _ = hf_checkpoint(arch)
    model = load_model(path).model
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 256, (14,), generator=g), torch.randint(0, 256, (9,), generator=g)]
    with torch.no_grad():
        expected = [model.compute_logits(model(t, torch.arange(len(t)))) for t in tokens]

    cpu = torch.device("cpu")
    KVPool.for_model(model, get_backend("cpu", cpu, torch.float32), NUM_BLOCKS, BLOCK_SIZE,
                     torch.float32, cpu, zeroed=True)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    block_tables = [perm[:4], perm[4:7]]  # shuffled, non-contiguous blocks

    # (chunk of positions for seq 0, chunk for seq 1) per step
    schedule = [
        (range(6), range(3)),          # prefill, chunk 1 (seq 0 ends mid-block)
        (range(6, 10), range(3, 6)),   # prefill, chunk 2
        (range(10, 11), range(6, 8)),  # seq 0 decodes while seq 1 still prefills
        (range(11, 12), range(8, 9)),  # decode only, both
        (range(12, 13), None),         # seq 1 paused
        (range(13, 14), None),
    ]
    for step in schedule:
        active = [(b, list(r)) for b, r in enumerate(step) if r is not None]
        meta = _metadata([(pos, pos[-1] + 1) for _, pos in active],
                         [block_tables[b] for b, _ in active])
        input_ids = torch.cat([tokens[b][pos] for b, pos in active])
        positions = torch.cat([torch.tensor(pos) for _, pos in active])
        with torch.no_grad(), attention_metadata(meta):
            logits = model.compute_logits(model(input_ids, positions))
        offset = 0
        for b, pos in active:
            got = logits[offset:offset + len(pos)]
            torch.testing.assert_close(got, expected[b][pos], atol=1e-4, rtol=0)
            offset += len(pos)


def test_missing_cache_is_a_clear_error(hf_checkpoint):
    path, _ = hf_checkpoint("llama")
    model = load_model(path).model
    meta = _metadata([([0, 1], 2)], [[0]])
    with torch.no_grad(), attention_metadata(meta), pytest.raises(RuntimeError, match="KV cache"):
        model(torch.tensor([1, 2]), torch.tensor([0, 1]))
