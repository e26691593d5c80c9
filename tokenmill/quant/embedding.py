"""The token embedding kept in the GGUF file's own blocks, rows dequantized on lookup.

A big model's embedding in bf16 is a float copy as large as an LM head (hidden 2048 x
49,152 tokens: 192 MiB, against 55 MiB in Q4_K): where the model keeps no float copy of
its linears (memory that scales, quant/model.py), the embedding keeps its blocks too and
dequantizes only the rows a step looks up (a few per decode step; a prompt's rows once),
with the gguf package's dequantization, then rounds to the model's dtype: the rows
F.embedding would return from the dequantized table."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize
from torch import nn


class GGUFEmbedding(nn.Module):
    def __init__(self, blocks: torch.Tensor, qtype: Any, shape: tuple[int, int],
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(shape[0]), int(shape[1])
        self.qtype = qtype
        self.dtype = dtype
        self.register_buffer("blocks", blocks.contiguous())  # uint8 (vocab, bytes per row)
        self._rows = self.blocks.numpy()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).cpu().numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        rows = gguf_dequantize(self._rows[ids], self.qtype).astype(np.float32, copy=False)
        out = torch.from_numpy(rows.reshape(*input_ids.shape, self.embedding_dim))
        return out.to(self.dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name} blocks, "
                f"rows as {self.dtype}")


def embedding_from_blocks(model: nn.Module, shards: list[Any] | None) -> bool:
    """model.model.embed_tokens -> a GGUFEmbedding over the loader's blocks (`shards`:
    its QuantizedWeights), where it is one whole table of a quantized type on the CPU
    (one tensor-parallel rank holding it all). Returns whether it was replaced."""
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    weight = getattr(embed, "weight", None)
    if (not shards or len(shards) != 1 or not isinstance(weight, torch.Tensor)
            or weight.device.type != "cpu" or tuple(shards[0].shape) != tuple(weight.shape)
            or weight.shape[0] != getattr(getattr(model, "config", None), "vocab_size", -1)):
        return False
    s = shards[0]
    inner.embed_tokens = GGUFEmbedding(s.blocks, s.qtype, s.shape, weight.dtype)
    return True
