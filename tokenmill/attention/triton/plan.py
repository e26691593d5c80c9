"""The per-step launch plan of the triton backend (plain torch: no triton import).

Built once per step by `TritonBackend.plan(meta)` and read by every layer: which
rows of the flat batch are decodes (one query) and which are prefill/extend
chunks, the split-K choice for the decodes, the prefill work list, and the
metadata tensors on the device, all moved there in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.metadata import AttentionMetadata

# Tiles. Every tl.dot is at least 16 in each dimension so it maps to tensor cores
# (mma.sync on sm_80, wgmma or mma on sm_90); the compile test checks the PTX.
DECODE_BLOCK_H = 16  # query heads of one KV group per program (padded)
DECODE_BLOCK_N = 64  # key positions per tile; split lengths are multiples of it
PREFILL_BLOCK_M = 64  # queries per program
PREFILL_BLOCK_N = 64
MAX_SPLITS = 64
# a split is one tile or more. A captured decode graph's plan is sized for
# max_model_len, so at 16 splits of 256+ keys a short context filled one to three of
# them: at batch 1 (Llama-3-8B shapes, 512 keys) 16-24 programs on an H200's 132 SMs
MIN_SPLIT_TOKENS = DECODE_BLOCK_N
REDUCE_CHUNK = 16  # splits the reduce combines at a time (it reads only those with keys)
# the `window` the kernels get for a layer without a sliding window: larger than any
# position, so q - k < window always holds (and int32-safe in their arithmetic)
NO_WINDOW = 1 << 30
NUM_WARPS = 4
NUM_STAGES = 2


def launch_options(kernel: str) -> dict[str, int]:
    """Launch options of the attention kernels ("decode", "prefill")."""
    return {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES}


@dataclass
class TritonPlan:
    query_start_loc: torch.Tensor  # (B + 1,) int32, on the device
    seq_lens: torch.Tensor  # (B,) int32
    block_tables: torch.Tensor  # (B, max_blocks) int32, contiguous
    block_size: int
    decode_seqs: torch.Tensor  # (num_decodes,) int32: batch index of each decode
    num_decodes: int
    num_splits: int  # split-K factor of the decodes; 1 = off
    split_len: int  # key positions per split, a multiple of DECODE_BLOCK_N
    tile_seqs: torch.Tensor  # (num_tiles,) int32: the sequence of each prefill tile
    tile_starts: torch.Tensor  # (num_tiles,) int32: its first query within the sequence
    num_tiles: int
    dummy: torch.Tensor  # a float32 stand-in for pointers a kernel variant never reads


def choose_splits(num_decodes: int, max_len: int, num_sms: int) -> int:
    """Split-K only when the decodes alone cannot fill the machine: enough splits
    that decodes * splits covers the SMs (KV heads multiply it further), none
    shorter than MIN_SPLIT_TOKENS."""
    if num_decodes == 0:
        return 1
    by_length = max(1, max_len // MIN_SPLIT_TOKENS)
    by_occupancy = -(-num_sms // num_decodes)
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


def build_plan(meta: AttentionMetadata, device: torch.device, num_sms: int,
               num_splits: int | None = None) -> TritonPlan:
    """num_splits: force the decode split count (tests); None chooses per step."""
    decodes = [b for b, n in enumerate(meta.query_lens_list) if n == 1]
    tiles = [(b, m0) for b, n in enumerate(meta.query_lens_list) if n > 1
             for m0 in range(0, n, PREFILL_BLOCK_M)]
    max_len = max((meta.seq_lens_list[b] for b in decodes), default=0)
    splits = num_splits or choose_splits(len(decodes), max_len, num_sms)
    splits = max(1, min(MAX_SPLITS, splits))
    split_len = DECODE_BLOCK_N * max(1, -(-max_len // (splits * DECODE_BLOCK_N)))
    splits = max(1, -(-max_len // split_len))  # no split starts past every sequence
    # the work lists go to the device in one copy, each at a 16-byte boundary (the
    # pointer alignment the compiled kernels are specialised for)
    parts = [decodes, [b for b, _ in tiles], [m0 for _, m0 in tiles]]
    offsets, flat = [], []
    for part in parts:
        offsets.append(len(flat))
        flat += part + [0] * (-len(part) % 4)
    lists = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
    nd, nt = len(decodes), len(tiles)
    return TritonPlan(
        query_start_loc=meta.query_start_loc.to(device, torch.int32),
        seq_lens=meta.seq_lens.to(device, torch.int32),
        block_tables=meta.block_tables.to(device, torch.int32).contiguous(),
        block_size=meta.block_size, decode_seqs=lists[offsets[0]:offsets[0] + nd],
        num_decodes=nd, num_splits=splits, split_len=split_len,
        tile_seqs=lists[offsets[1]:offsets[1] + nt],
        tile_starts=lists[offsets[2]:offsets[2] + nt], num_tiles=nt,
        dummy=torch.empty(1, dtype=torch.float32, device=device))
