"""Speculative decoding: a proposer guesses k tokens, the target scores them
all in one forward, verification keeps exactly what the target would have
produced. See speculator.py for the four engine calls, verify.py for why the
outputs are exact, docs/speculative.md for usage and numbers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.engine.speculative.proposer import Proposer
from tokenmill.engine.speculative.speculator import Speculator
from tokenmill.engine.speculative.stats import SpecStats

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.runner.model_runner import ModelRunner
    from tokenmill.kvcache.block_manager import BlockManager

__all__ = ["Proposer", "SpecStats", "Speculator", "build_speculator"]


def build_speculator(config: EngineConfig, runner: ModelRunner, block_manager: BlockManager,
                     max_model_len: int, dtype: torch.dtype) -> Speculator:
    proposer: Proposer
    if config.speculative == "ngram":
        from tokenmill.engine.speculative.ngram import NgramProposer

        proposer = NgramProposer(config.ngram_min, config.ngram_max)
    elif config.speculative == "layerskip":
        from tokenmill.engine.speculative.layerskip import LayerSkipProposer

        num_layers = runner.config.num_hidden_layers
        proposer = LayerSkipProposer(runner, config.draft_layers or max(1, num_layers // 4))
    elif config.speculative == "draft":
        from tokenmill.engine.speculative.draft import DraftModelProposer

        assert config.draft_model
        proposer = DraftModelProposer.load(config.draft_model, runner, dtype)
    else:
        raise ValueError(f"unknown speculative method {config.speculative!r}")
    return Speculator(proposer, block_manager, config.num_speculative_tokens,
                      config.max_num_batched_tokens, max_model_len, config.spec_max_batch)
