"""KV-cache events in vLLM's wire format, recorded as the prefix cache changes.

A router that knows which replica holds which prefix (vllm-router's
`kv_aware` policy, llm-d's precise prefix scorer, Dynamo's KV router) follows
these events. The Structs mirror `vllm.distributed.kv_events` of vLLM 0.32
(the release vllm-router 0.1.17 decodes) field for field: a batch is an array
`[ts, events, data_parallel_rank]`, an event a map tagged by its class name
(`{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ...,
"token_ids": [...], "block_size": 16, "lora_id": null, "medium": null,
"lora_name": null}`). An adapter's blocks carry its `lora_id` / `lora_name` and,
per block, vLLM's untagged extra key `(lora_name,)`; like vLLM, the first block of
any chain (the base's or an adapter's) goes out with parent None, never the
adapter's private root hash, which no consumer has seen. Block hashes go out as unsigned 64-bit integers, as
vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` sends them (the router rejects
negative ones); a consumer only needs them to match BlockRemoved to
BlockStored, and rebuilds its own keys from the token ids.

`KVEventRecorder` is what the prefix cache calls; it coalesces consecutive
stores of one chain (each block's parent is the previous block) into one
`BlockStored`, as vLLM emits one per contiguous run of newly hashed blocks.
Plain Python (msgspec, no torch).
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

_U64 = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # one entry per block (vLLM's to_event_extra_keys): (lora_name,) for an adapter's
    # blocks; omitted for the base, which has no extra keys
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Adapter(Protocol):
    """What an event needs of a LoRA request (tokenmill.lora_request.LoRARequest)."""

    lora_int_id: int
    lora_name: str


class KVEventRecorder:
    """Collects the prefix cache's changes between two `take()` calls."""

    def __init__(self, block_size: int, medium: str | None = None) -> None:
        self.block_size = block_size
        # vLLM names its device cache "GPU"; None ("unspecified") for a CPU engine's
        # own cache, which is no offload tier ("CPU" would read as one to a router)
        self.medium = medium
        self._events: list[KVCacheEvent] = []

    def stored(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...],
               adapter: Adapter | None = None) -> None:
        """One newly cached block; `parent_hash` None for the first block of a chain."""
        block_hash, last = block_hash & _U64, self._events[-1] if self._events else None
        lora_id = adapter.lora_int_id if adapter is not None else None
        if (isinstance(last, BlockStored) and parent_hash is not None
                and last.block_hashes[-1] == parent_hash & _U64 and last.lora_id == lora_id):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            if last.extra_keys is not None:
                last.extra_keys.append(last.extra_keys[-1])
            return
        parent = None if parent_hash is None else parent_hash & _U64
        self._events.append(BlockStored(
            block_hashes=[block_hash], parent_block_hash=parent, token_ids=list(token_ids),
            block_size=self.block_size, lora_id=lora_id, medium=self.medium,
            lora_name=adapter.lora_name if adapter is not None else None,
            extra_keys=[(adapter.lora_name,)] if adapter is not None else None))

    def removed(self, block_hash: int) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash & _U64)
        else:
            self._events.append(BlockRemoved(block_hashes=[block_hash & _U64],
                                              medium=self.medium))

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]  # what came before is moot

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
