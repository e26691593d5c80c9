"""A smaller model with the same tokenizer drafts the next tokens greedily.

It keeps its own paged KV cache: a ModelRunner over the draft model and a
BlockManager of the same class (no prefix caching), with as many blocks as
the target's cache, so that it can hold the same token positions. Each
target sequence has a shadow Sequence here (same token ids; its own block
table and `num_computed_tokens`). Per step, for every proposing sequence:
  1. sync: the shadow keeps the K/V of the tokens it computed that the target
     kept (its prefix up to the first rejected draft), the rest is rolled back
     with `free_slots_beyond`;
  2. one catch-up chunk feeds what the shadow has not computed yet (the whole
     prompt the first time, then usually 1-2 tokens) and yields draft 1;
  3. k - 1 single-token steps yield the rest.
All proposing sequences run batched in each of these forwards. Shadows are
freed when their sequence finishes, is aborted or preempted.
"""

from __future__ import annotations

import torch

from tokenmill.engine.core.scheduler import ScheduledSeq
from tokenmill.engine.runner.model_runner import ModelRunner
from tokenmill.kvcache.block_manager import BlockManager
from tokenmill.sequence import Sequence


class DraftModelProposer:
    min_acceptance = 0.4
    runs_a_model = True

    def __init__(self, runner: ModelRunner, block_manager: BlockManager) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.shadows: dict[int, Sequence] = {}  # target seq_id -> shadow
        self._synced_len: dict[int, int] = {}  # target seq_id -> its length at the last sync

    @classmethod
    def load(cls, draft_model: str, target: ModelRunner, dtype: torch.dtype
             ) -> DraftModelProposer:
        from tokenmill.loaders import load_model, resolve_model

        loaded = load_model(resolve_model(draft_model), dtype=dtype, device=target.device)
        if loaded.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({loaded.config.vocab_size}) "
                             f"differs from the target's ({target.config.vocab_size})")
        runner = ModelRunner(loaded.model, loaded.config, target.block_size, target.num_blocks,
                             loaded.dtype, target.device, target.backend.name)
        return cls(runner, BlockManager(target.num_blocks, target.block_size,
                                        enable_prefix_caching=False))

    def forget(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._synced_len.pop(seq.seq_id, None)
            shadow = self.shadows.pop(seq.seq_id, None)
            if shadow is not None:
                self.block_manager.free(shadow)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        shadows: list[Sequence | None] = []
        for seq, n in zip(seqs, k):
            shadow = self._sync(seq)
            # slots for the uncomputed tokens and drafts 1..n-1 (the n-th is never fed)
            need = seq.num_tokens - shadow.num_computed_tokens + n - 1
            ok = n > 0 and self.block_manager.allocate_slots(shadow, need)
            shadows.append(shadow if ok else None)
        for step in range(max(k, default=0)):
            active = [i for i, s in enumerate(shadows) if s is not None and k[i] > step]
            if not active:
                break
            items = []
            for i in active:
                shadow = shadows[i]
                assert shadow is not None
                items.append(ScheduledSeq(shadow, shadow.num_uncomputed_tokens, sample=True))
            ids, pos, meta, rows = self.runner.prepare(items)
            tokens = self.runner.forward(ids, pos, meta, rows).argmax(dim=-1).tolist()
            for i, item, token in zip(active, items, tokens):
                drafts[i].append(token)
                item.seq.num_computed_tokens += item.num_new_tokens
                item.seq.token_ids.append(token)
        return drafts

    def _sync(self, seq: Sequence) -> Sequence:
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(seq.request_id, seq.token_ids, seq.sampling_params)
            self.shadows[seq.seq_id] = shadow
        else:
            self._rollback(shadow, seq)
        self._synced_len[seq.seq_id] = seq.num_tokens
        return shadow

    def _rollback(self, shadow: Sequence, seq: Sequence) -> None:
        # the shadow's computed tokens that the target kept: they can differ
        # only past the target's length when the shadow last proposed
        old, new = shadow.token_ids, seq.token_ids
        valid = min(shadow.num_computed_tokens, seq.num_tokens - 1)  # one left to feed
        for i in range(self._synced_len[seq.seq_id], valid):
            if old[i] != new[i]:
                valid = i
                break
        shadow.num_computed_tokens = valid
        shadow.token_ids = list(new)
        self.block_manager.free_slots_beyond(shadow, valid)
