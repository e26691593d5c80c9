"""A step's flat-batch rows grouped by LoRA adapter (models/lora.py's `lora_batch`)."""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)
_logged = False


def lora_groups(inputs: Any, device: torch.device) -> dict[int, torch.Tensor] | None:
    """adapter id -> int64 rows of the step's tokens that run under it (the base's
    rows, id 0, are left out: they get no delta). None when no row has an adapter."""
    rows: dict[int, list[int]] = {}
    start = 0
    for lora_id, n in zip(inputs.lora_ids, inputs.query_lens):
        if lora_id:
            rows.setdefault(lora_id, []).extend(range(start, start + n))
        start += n
    if not rows:
        return None
    return {i: torch.tensor(r, dtype=torch.int64, device=device) for i, r in rows.items()}


def log_lora_module_path() -> None:
    """A decode step with adapters that the fused native step could not take (an adapter
    over its rank limit, a linear it does not wrap): say so once."""
    global _logged
    if not _logged:
        _logged = True
        logger.info("LoRA: a decode step with adapters ran the module path (an adapter "
                    "the fused native decode step cannot take)")
