"""The token embedding kept in the GGUF file's own blocks, rows dequantized on lookup.

A big model's embedding in bf16 is a float copy as large as an LM head (hidden 2048 x
49,152 tokens: 192 MiB, against 55 MiB in Q4_K): where the model keeps no float copy of
its linears (memory that scales, quant/model.py), the embedding keeps its blocks too and
dequantizes only the rows a step looks up (a few per decode step; a prompt's rows once),
with the gguf package's dequantization, then rounds to the model's dtype: the rows
F.embedding would return from the dequantized table.

A tied embedding (the LM head is the same tensor: SmolLM2, Llama 3.2 1B) is kept once:
its rows are read back from the LM head's kernel records (RecordsEmbedding,
record_rows.py) instead of a second copy in blocks. They are the weights the head
multiplies: gguf's dequantization exactly where the records are exact (Q8_0, Q4_0,
Q4_1, Q5_0), else within the records' form (gguf_records.FORMS)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize
from torch import nn

from tokenmill.quant import record_rows


class LookupEmbedding(nn.Module):
    """An embedding whose rows are computed on lookup (no float table); the fused decode
    step asks it for a step's rows."""

    num_embeddings: int
    embedding_dim: int
    dtype: torch.dtype

    def resident_bytes(self) -> int:
        """Bytes held for this table alone (0 where they are another module's)."""
        raise NotImplementedError

    def _ids(self, input_ids: torch.Tensor) -> np.ndarray:
        ids = input_ids.reshape(-1).cpu().numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        return ids


class GGUFEmbedding(LookupEmbedding):
    def __init__(self, blocks: torch.Tensor, qtype: Any, shape: tuple[int, int],
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(shape[0]), int(shape[1])
        self.qtype = qtype
        self.dtype = dtype
        self.register_buffer("blocks", blocks.contiguous())  # uint8 (vocab, bytes per row)
        self._rows = self.blocks.numpy()

    def resident_bytes(self) -> int:
        return self.blocks.nbytes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = self._ids(input_ids)
        rows = gguf_dequantize(self._rows[ids], self.qtype).astype(np.float32, copy=False)
        out = torch.from_numpy(rows.reshape(*input_ids.shape, self.embedding_dim))
        return out.to(self.dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name} blocks, "
                f"rows as {self.dtype}")


class RecordsEmbedding(LookupEmbedding):
    """A tied embedding's rows read from the LM head's records (the head's module is
    held as a plain attribute: its records are counted once, as the head's)."""

    def __init__(self, head: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.dtype = dtype
        self.__dict__["head"] = head  # not a submodule: the head stays where it is

    def resident_bytes(self) -> int:
        return 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = self._ids(input_ids)
        head = self.__dict__["head"]
        rows = record_rows.rows_of_records(head.vnni_packed, head.vnni_format,
                                           self.embedding_dim, ids)
        out = torch.from_numpy(rows.reshape(*input_ids.shape, self.embedding_dim))
        return out.to(self.dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, the LM head's records, "
                f"rows as {self.dtype}")


def embedding_from_head(model: nn.Module, shards: list[Any] | None) -> bool:
    """model.model.embed_tokens -> a RecordsEmbedding over the LM head's records where
    the head is the same tensor (a tied model: the loader gave the head the embedding's
    `shards`), one whole table on the CPU on the quantized-activation kernel. Returns
    whether it was replaced."""
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    weight = getattr(embed, "weight", None)
    head = getattr(model, "lm_head", None)
    if (not shards or not isinstance(weight, torch.Tensor) or weight.device.type != "cpu"
            or not getattr(getattr(model, "config", None), "tie_word_embeddings", False)
            or head is None
            or not isinstance(getattr(head, "vnni_packed", None), torch.Tensor)
            or getattr(head, "activations", "bf16") == "bf16"
            or (head.out_features, head.in_features) != tuple(weight.shape)
            or weight.shape[0] != getattr(getattr(model, "config", None), "vocab_size", -1)):
        return False
    inner.embed_tokens = RecordsEmbedding(head, weight.dtype)
    return True


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
