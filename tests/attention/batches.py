"""Random paged batches for attention-kernel tests: a flat varlen batch of decodes
and prefill chunks over fragmented block tables, with NaN in every unused slot."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from tokenmill.attention.metadata import AttentionMetadata


@dataclass
class PagedBatch:
    q: torch.Tensor  # (T, heads, d)
    k: torch.Tensor  # (T, kv_heads, d): this step's keys
    v: torch.Tensor
    k_cache: torch.Tensor  # (num_blocks, block_size, kv_heads, d), the triton layout
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_batch(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, seed: int = 0,
               num_blocks: int | None = None,
               device: torch.device | str = "cpu") -> PagedBatch:
    """seqs: (cached prefix length, new tokens) per sequence. The prefix is written into
    the caches; the new tokens' K/V are returned for the KV store (not yet written).
    Blocks are handed out in a shuffled order, so every table is fragmented."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(ctx + n) // block_size) for ctx, n in seqs]
    num_blocks = num_blocks or sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used:used + n])
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)

    def rand(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g).to(dtype)

    slots, qs, ks, vs = [], [], [], []
    for (ctx, n), table in zip(seqs, tables):
        prefix = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        k_cache.view(-1, num_kv_heads, head_dim)[prefix] = rand(ctx, num_kv_heads, head_dim)
        v_cache.view(-1, num_kv_heads, head_dim)[prefix] = rand(ctx, num_kv_heads, head_dim)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(ctx, ctx + n)]
        qs.append(rand(n, num_heads, head_dim))
        ks.append(rand(n, num_kv_heads, head_dim))
        vs.append(rand(n, num_kv_heads, head_dim))
    query_lens = [n for _, n in seqs]
    seq_lens = [ctx + n for ctx, n in seqs]
    width = max(need)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        block_size=block_size, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_list=query_lens, seq_lens_list=seq_lens)
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(meta, name, getattr(meta, name).to(device))
    return PagedBatch(torch.cat(qs).to(device), torch.cat(ks).to(device),
                      torch.cat(vs).to(device), k_cache.to(device), v_cache.to(device), meta)


def reference(batch: PagedBatch, scale: float) -> torch.Tensor:
    """The torch backend's answer in fp32, from the triton-layout caches (which must
    already hold this step's K/V)."""
    from tokenmill.attention.torch_ref import paged_attention_reference

    def ref_layout(cache: torch.Tensor) -> torch.Tensor:
        # -> (kv_heads, num_blocks, block_size, d), on the CPU
        return cache.permute(2, 0, 1, 3).float().cpu()

    meta = copy.copy(batch.meta)
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(meta, name, getattr(meta, name).cpu())
    return paged_attention_reference(batch.q.float().cpu(), ref_layout(batch.k_cache),
                                     ref_layout(batch.v_cache), meta, scale)
