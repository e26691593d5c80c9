"""Prefix cache: full KV blocks found again by the content of the tokens before them.

A block's key is a chained hash, `hash_block(parent_hash, tokens)`, so one key
names the whole prefix up to the end of that block. Each entry also stores
its parent hash and tokens, and a lookup checks both: a hash collision can
cost a cache miss, never a wrong hit.

Blocks whose ref count drops to 0 keep their entry and wait in an LRU
("evictable"); they are handed out again as fresh blocks only when no
never-cached block is free, least recently freed first. The block manager
owns ref counts and the plain free list; this class owns hashes and the LRU.
With `events` set (a KVEventRecorder), every entry stored, evicted or reset
is also recorded, for routers that follow where each prefix lives.
Plain Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.kvcache.events import Adapter, KVEventRecorder

ROOT_HASH = 0  # parent hash of a sequence's first block under the base model


def root_hash(lora_id: int) -> int:
    """The parent hash of a first block: the same prompt under two LoRA adapters (or an
    adapter and the base) is different KV, so each adapter roots its own chain."""
    return ROOT_HASH if not lora_id else hash(("lora", lora_id))


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The chained key of one full block. Python's hash of a tuple of ints is
    64-bit and the same in every process (PYTHONHASHSEED only salts str/bytes)."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass(frozen=True)
class _Entry:
    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


class PrefixCache:
    def __init__(self) -> None:
        self._block_by_hash: dict[int, int] = {}
        self._entry_by_block: dict[int, _Entry] = {}
        # cached blocks with ref count 0, least recently freed first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.events: KVEventRecorder | None = None

    def __len__(self) -> int:
        return len(self._entry_by_block)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def lookup(self, parent_hash: int, token_ids: Sequence[int]) -> tuple[int, int | None]:
        """(the block's hash, the cached block holding exactly this prefix, or None)."""
        block_hash = hash_block(parent_hash, token_ids)
        block_id = self._block_by_hash.get(block_hash)
        if block_id is None:
            return block_hash, None
        entry = self._entry_by_block[block_id]
        if entry.parent_hash != parent_hash or entry.token_ids != tuple(token_ids):
            return block_hash, None  # a collision: different content under the same key
        return block_hash, block_id

    def insert(self, block_id: int, parent_hash: int, token_ids: Sequence[int],
               adapter: Adapter | None = None) -> int | None:
        """Register a just-filled block; return its hash, or None on a hash collision
        with different content (the caller then stops chaining from this block).
        `adapter`: the LoRA request the block was computed under (None: the base),
        which `parent_hash` already keys; events name it.

        If the same content is already cached in another block (two identical
        prompts computed in the same step), the existing entry stays and this
        block remains unregistered, but its hash is still valid for chaining."""
        block_hash = hash_block(parent_hash, token_ids)
        owner = self._block_by_hash.get(block_hash)
        if owner is None:
            assert block_id not in self._entry_by_block, "block is already cached"
            self._block_by_hash[block_hash] = block_id
            entry = _Entry(block_hash, parent_hash, tuple(token_ids))
            self._entry_by_block[block_id] = entry
            if self.events is not None:
                first = parent_hash == root_hash(adapter.lora_int_id if adapter else 0)
                self.events.stored(block_hash, None if first else parent_hash,
                                   entry.token_ids, adapter)
            return block_hash
        entry = self._entry_by_block[owner]
        if entry.parent_hash != parent_hash or entry.token_ids != tuple(token_ids):
            return None
        return block_hash

    def contains_block(self, block_id: int) -> bool:
        return block_id in self._entry_by_block

    def release(self, block_id: int) -> None:
        """A cached block's ref count reached 0: it becomes the most recent evictable."""
        self._evictable[block_id] = None

    def reclaim(self, block_id: int) -> bool:
        """A prefix hit takes a block back; True if it was waiting in the LRU."""
        if block_id not in self._evictable:
            return False
        del self._evictable[block_id]
        return True

    def evict(self) -> int | None:
        """Forget the least recently freed cached block and return it for reuse."""
        if not self._evictable:
            return None
        block_id, _ = self._evictable.popitem(last=False)
        entry = self._entry_by_block.pop(block_id)
        del self._block_by_hash[entry.block_hash]
        if self.events is not None:
            self.events.removed(entry.block_hash)
        return block_id

    @property
    def evictable_blocks(self) -> list[int]:
        return list(self._evictable)

    def problems(self) -> list[str]:
        """What is inconsistent inside the cache (empty when all is well): every
        hash names the block whose entry carries that hash, every entry's hash is
        the hash of its content, every evictable block has an entry."""
        found = []
        if len(self._block_by_hash) != len(self._entry_by_block):
            found.append(f"{len(self._block_by_hash)} hashes but "
                         f"{len(self._entry_by_block)} cached blocks")
        for block_hash, block_id in self._block_by_hash.items():
            entry = self._entry_by_block.get(block_id)
            if entry is None or entry.block_hash != block_hash:
                found.append(f"hash {block_hash:#x} points at block {block_id}, whose entry "
                             f"{'is missing' if entry is None else 'has another hash'}")
        for block_id, entry in self._entry_by_block.items():
            if hash_block(entry.parent_hash, entry.token_ids) != entry.block_hash:
                found.append(f"block {block_id}'s hash does not match its tokens")
            if self._block_by_hash.get(entry.block_hash) != block_id:
                found.append(f"block {block_id} is cached but its hash does not find it")
        for block_id in self._evictable:
            if block_id not in self._entry_by_block:
                found.append(f"evictable block {block_id} is not cached")
        return found

    def reset(self) -> list[int]:
        """Forget every entry; return the evictable blocks, now plain free blocks.
        Blocks still in use simply stop being findable."""
        freed = list(self._evictable)
        self._block_by_hash.clear()
        self._entry_by_block.clear()
        self._evictable.clear()
        if self.events is not None:
            self.events.cleared()
        return freed
