"""The model's layers grouped by attention type, as the KV cache sees them (torch-free).

Gemma 3 interleaves sliding-window layers (each query sees the last W keys) with
global ones (every 6th). tokenmill keeps ONE block table per sequence for all layers
(the design choice, documented in docs/sliding_window.md): each layer's pool holds
every block of the sequence, so a sliding layer's blocks behind its window stay
allocated. No block ever falls outside *every* layer's window while a global layer
reads the whole context, so freeing one would need a second block table for the
sliding group (vLLM's hybrid allocator: one KV cache group per attention type, each
with its own block table, prefix-cache hashes and eviction). The numbers below say
what is allocated, and what that second table would save, so nobody has to guess.

`group_idx` follows vLLM 0.32's KV cache groups: 0 the full-attention layers, 1 the
sliding ones; KV events publish the blocks of group 0 (the one block table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AttentionGroups:
    num_layers: int
    num_global_layers: int
    sliding_window: int | None  # None: no layer has a window
    bytes_per_token_per_layer: int  # K and V of one token in one layer

    @property
    def num_sliding_layers(self) -> int:
        return self.num_layers - self.num_global_layers

    def kv_bytes_per_sequence(self, num_tokens: int) -> int:
        """What a sequence of num_tokens holds in the pool: every layer, every token."""
        return self.num_layers * num_tokens * self.bytes_per_token_per_layer

    def kv_bytes_per_sequence_windowed(self, num_tokens: int) -> int:
        """What it would hold with a block table per attention type: sliding layers
        only their last W tokens (block rounding left out)."""
        window = min(num_tokens, self.sliding_window or num_tokens)
        return self.bytes_per_token_per_layer * (
            self.num_global_layers * num_tokens + self.num_sliding_layers * window)

    def describe(self, max_model_len: int) -> dict[str, Any]:
        """For /server_info: the layout, and the bytes per sequence at max_model_len."""
        return {
            "sliding_window": self.sliding_window,
            "kv_cache_groups": [
                {"group_idx": 0, "attention": "full", "num_layers": self.num_global_layers},
                {"group_idx": 1, "attention": "sliding_window", "num_layers":
                 self.num_sliding_layers, "sliding_window": self.sliding_window},
            ] if self.sliding_window else [
                {"group_idx": 0, "attention": "full", "num_layers": self.num_layers}],
            # one block table for every layer: sliding layers hold the whole context too
            "sliding_blocks_freed": False,
            "kv_bytes_per_sequence": self.kv_bytes_per_sequence(max_model_len),
            "kv_bytes_per_sequence_if_windowed":
                self.kv_bytes_per_sequence_windowed(max_model_len),
        }


def attention_groups(config: Any, kv_bytes_per_block: int, block_size: int
                     ) -> AttentionGroups:
    """config: a ModelConfig (its layer_window(i)); kv_bytes_per_block: every layer's
    K and V for one block (kvcache/budget.py)."""
    n = config.num_hidden_layers
    windows = [config.layer_window(i) for i in range(n)]
    per_token_layer = kv_bytes_per_block // (block_size * n)
    return AttentionGroups(n, sum(w is None for w in windows),
                           next((w for w in windows if w is not None), None), per_token_layer)


def log_attention_groups(logger: Any, groups: AttentionGroups, max_model_len: int) -> None:
    """One start-up line where some layers slide: what a sequence costs, and why."""
    if groups.sliding_window is None:
        return
    logger.info("KV cache: %d of %d layers global, %d sliding (window %d); one block table "
                "for all layers, so the sliding ones keep every block: %.1f MiB per "
                "%d-token sequence (%.1f MiB with a block table per attention type, which "
                "tokenmill does not build: docs/sliding_window.md)",
                groups.num_global_layers, groups.num_layers, groups.num_sliding_layers,
                groups.sliding_window, groups.kv_bytes_per_sequence(max_model_len) / 2**20,
                max_model_len, groups.kv_bytes_per_sequence_windowed(max_model_len) / 2**20)
