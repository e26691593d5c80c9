"""Self-speculation: the target's own first L layers, then its final norm and
LM head, draft the next tokens. No extra weights and no extra KV cache.

Why no KV cache of its own: layer i's K/V at a position depend only on the
tokens and layers below i, so for every token the target already computed,
the target's cache of layers 0..L-1 *is* the draft's cache. The draft writes
its own proposals' K/V into the target's slots for those positions (layers
0..L-1 only), which the speculator has already allocated for verification;
the verifying forward then overwrites every layer at those positions before
attending to them, and rollback frees whatever was rejected. So the draft
runs k single-token steps of L layers each and never recomputes the context.

The draft is the target truncated without training for it, so acceptance is
modest on small models; the per-sequence back-off turns it off where it does
not pay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention.metadata import attention_metadata
from tokenmill.engine.runner.model_runner import ModelRunner
from tokenmill.sequence import Sequence


@dataclass
class _View:
    """What the runner reads of a sequence: tokens, computed count, block table."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    lora_int_id: int = 0  # speculation runs without adapters (--enable-lora refuses it)


@dataclass
class _Item:
    seq: _View
    num_new_tokens: int = 1
    sample: bool = True
    num_draft_tokens: int = 0


class LayerSkipProposer:
    min_acceptance = 0.4  # each draft token costs L / num_layers of a target step
    runs_a_model = True

    def __init__(self, runner: ModelRunner, num_layers: int) -> None:
        total = len(runner.model.model.layers)
        if not 1 <= num_layers < total:
            raise ValueError(f"draft_layers must be in [1, {total - 1}], got {num_layers}")
        self.runner = runner
        self.num_layers = num_layers

    def forget(self, seqs: list[Sequence]) -> None:
        pass

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: list[int]) -> list[list[int]]:
        views = [_View(list(s.token_ids), s.num_computed_tokens, s.block_table) for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        for step in range(max(k, default=0)):
            active = [i for i, n in enumerate(k) if n > step]
            items = [_Item(views[i]) for i in active]
            ids, pos, meta, _ = self.runner.prepare(items)
            with attention_metadata(meta):
                hidden = self._truncated_forward(ids, pos)  # (len(active), hidden)
            tokens = self.runner.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for i, token in zip(active, tokens):
                drafts[i].append(token)
                views[i].token_ids.append(token)
                views[i].num_computed_tokens += 1
        return drafts

    def _truncated_forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        decoder = self.runner.model.model
        x = decoder.embed_tokens(ids)  # (T, hidden)
        residual = None
        for layer in decoder.layers[:self.num_layers]:
            x, residual = layer(pos, x, residual)
        return decoder.norm.add_forward(x, residual)[0]
