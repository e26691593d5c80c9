"""The KV-cache block manager: fixed-size blocks, a free list and ref counts.

Blocks are ints 0..num_blocks-1; block `b` holds the K/V of token slots
`b * block_size .. b * block_size + block_size - 1`, and the model runner
maps a sequence's token at position `p` to slot
`block_table[p // block_size] * block_size + p % block_size`. A sequence's
fresh blocks are taken adjacent where the pool allows (`_take_fresh_run`), and
at admission the free blocks after its own are held back for it to grow into
(`_hold_back`): decode attention on a CPU reads adjacent blocks faster.

Check, then commit: `can_allocate_slots` answers without changing anything,
and `allocate_slots` returns False, with nothing changed, when it cannot
allocate everything. Nothing is ever half-allocated.

Life of a sequence's blocks:
  1. admission: `prefix = get_computed_blocks(seq)` finds the longest cached run
     of its full blocks (never all of its tokens: one must be computed to
     get logits), then `allocate_slots(seq, n, prefix)` shares those blocks,
     sets `seq.num_computed_tokens` past them and adds fresh blocks for `n`
     new tokens;
  2. every later step: `allocate_slots(seq, n)` grows the table to cover
     `num_computed_tokens + n` slots;
  3. after the model ran and `num_computed_tokens` was advanced:
     `cache_full_blocks(seq)` registers blocks that became full;
  4. `free(seq)` on finish or preemption: cached blocks at ref count 0 stay
     findable until evicted (see prefix_cache.py).
Plain Python, no torch.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tokenmill.kvcache.prefix_cache import PrefixCache, hash_block, root_hash
from tokenmill.sequence import Sequence

MAX_HELD_BACK = 64  # blocks held back past a sequence's admitted ones: 1,024 tokens


class KVCacheIntegrityError(AssertionError):
    """The block manager's books disagree: a leak, a double free, a stale hash."""


@dataclass(frozen=True)
class CachedPrefix:
    """The leading full blocks of a sequence found in the prefix cache."""

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_tokens: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # free, never-cached blocks, taken last-freed first: a block freed a moment ago is
        # still in cache and its pages resident, where the pool's oldest free block may
        # never have been touched (its pages faulted in, and zeroed, on first use)
        self._free = FreeList(range(num_blocks - 1, -1, -1))
        # blocks ever handed out: the pool's memory is touched lazily, block by block
        self._touched = bytearray(num_blocks)
        self.num_touched_blocks = 0
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.prefix_cache_queries = 0  # tokens of admitted sequences looked up
        self.prefix_cache_hits = 0  # of those, tokens served from the cache

    @property
    def enable_prefix_caching(self) -> bool:
        return self.prefix_cache is not None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached (evictable) ones included."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return len(self._free) + evictable

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by some sequence (ref count > 0)."""
        return (self.num_total_blocks - self.num_free_blocks) / self.num_total_blocks

    def max_tokens_that_fit(self) -> int:
        """The most tokens (prompt + output) one sequence can ever hold."""
        return self.num_total_blocks * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> CachedPrefix:
        """The longest run of `seq`'s leading full blocks already in the cache.
        Side-effect free; call it for a sequence that holds no blocks. None for
        one that asks prompt logprobs: a cached block has no logits."""
        if (self.prefix_cache is None or seq.block_table
                or seq.sampling_params.prompt_logprobs is not None):
            return CachedPrefix()
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs  # leave >= 1 token to compute
        block_ids: list[int] = []
        hashes: list[int] = []
        parent = root_hash(seq.lora_int_id)
        for i in range(max_blocks):
            parent, block_id = self.prefix_cache.lookup(parent, seq.token_ids[i * bs:(i + 1) * bs])
            if block_id is None:
                break
            block_ids.append(block_id)
            hashes.append(parent)
        return CachedPrefix(block_ids, hashes, len(block_ids) * bs)

    def can_allocate_slots(self, seq: Sequence, num_new_tokens: int,
                           prefix: CachedPrefix | None = None) -> bool:
        return self._num_blocks_to_take(seq, num_new_tokens, prefix) <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       prefix: CachedPrefix | None = None) -> bool:
        """Grow `seq.block_table` to cover `num_computed_tokens + num_new_tokens`
        slots; with `prefix` (admission only), first share its cached blocks and
        count them as computed. False, with nothing changed, if blocks run short."""
        if not self.can_allocate_slots(seq, num_new_tokens, prefix):
            return False
        if prefix is not None:
            self._admit_prefix(seq, prefix)
        num_needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        seq.block_table.extend(self._take_fresh_run(
            num_needed - len(seq.block_table),
            seq.block_table[-1] + 1 if seq.block_table else None))
        if prefix is not None and seq.block_table:  # admission: room to grow into
            max_tokens = seq.sampling_params.max_tokens or 0
            growth = self.num_blocks_for(seq.num_prompt_tokens + max_tokens)
            self._hold_back(seq.block_table[-1] + 1,
                            min(MAX_HELD_BACK, growth - len(seq.block_table)))
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register each block of `seq` that is full of computed tokens and not
        yet registered. Call after advancing `seq.num_computed_tokens`."""
        if self.prefix_cache is None:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq.lora_int_id)
            block_hash = self.prefix_cache.insert(
                seq.block_table[i], parent, seq.token_ids[i * bs:(i + 1) * bs],
                seq.lora_request)
            if block_hash is None:  # hash collision: leave the rest unregistered
                return
            seq.block_hashes.append(block_hash)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks. Last blocks first, so that when cached
        blocks are evicted a prefix's tail goes before its head."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()

    def share(self, block_ids: list[int]) -> None:
        """Take one more reference on blocks some sequence holds (a KV transfer pins a
        finished request's blocks so; the pin then counts as a live holder)."""
        for block_id in block_ids:
            assert self.ref_counts[block_id] > 0, f"block {block_id} is not held"
            self.ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop the references `share` took, last block first (as `free`)."""
        for block_id in reversed(block_ids):
            self._release(block_id)

    def free_slots_beyond(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink `seq.block_table` to exactly cover `num_tokens` slots (roll back
        rejected speculative tokens). Registered blocks must not be cut."""
        assert num_tokens >= len(seq.block_hashes) * self.block_size, "would cut a cached block"
        num_keep = self.num_blocks_for(num_tokens)
        while len(seq.block_table) > num_keep:
            self._release(seq.block_table.pop())

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after swapping weights). Sequences keep
        their blocks; idle cached blocks become plain free blocks."""
        if self.prefix_cache is not None:
            self._free.extend(self.prefix_cache.reset())
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def check_integrity(self, live: Iterable[Sequence]) -> None:
        """Raise KVCacheIntegrityError, naming every violation, unless ref counts,
        the free list, the prefix cache's LRU and hash table, and the block tables
        of `live` (every sequence that may hold blocks) all agree:
        - each block's ref count is the number of live block tables holding it;
        - each block is in exactly one place: held (ref > 0), the free list, or
          the evictable LRU; free-list blocks are never cached;
        - each registered hash of a live sequence is the chained hash of its
          tokens, and every cache entry is findable by its own hash.
        O(blocks + live tokens): for tests and --debug-kv-integrity."""
        found: list[str] = []
        holders: Counter[int] = Counter()
        bs = self.block_size
        for seq in live:
            table = seq.block_table
            if len(set(table)) != len(table):
                found.append(f"sequence {seq.seq_id} holds a block twice: {table}")
            holders.update(table)
            if len(table) < self.num_blocks_for(seq.num_computed_tokens):
                found.append(f"sequence {seq.seq_id} computed {seq.num_computed_tokens} "
                             f"tokens but holds only {len(table)} blocks")
            if len(seq.block_hashes) > len(table):
                found.append(f"sequence {seq.seq_id} has more block hashes than blocks")
            parent = root_hash(seq.lora_int_id)
            for i, block_hash in enumerate(seq.block_hashes):
                if hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs]) != block_hash:
                    found.append(f"sequence {seq.seq_id}'s hash of block {i} does not "
                                 "match its tokens")
                    break
                parent = block_hash
        for block_id in holders:
            if not 0 <= block_id < self.num_total_blocks:
                found.append(f"a block table holds block {block_id}, outside the pool")
        for block_id, rc in enumerate(self.ref_counts):
            if rc != holders[block_id]:
                found.append(f"block {block_id} has ref count {rc} but {holders[block_id]} "
                             "live sequences hold it")
        free = list(self._free)
        in_free = Counter(free)
        in_lru = Counter(self.prefix_cache.evictable_blocks if self.prefix_cache else [])
        for block_id in range(self.num_total_blocks):
            held = self.ref_counts[block_id] > 0
            n = in_free[block_id] + in_lru[block_id] + held
            if n != 1:
                where = ["held"] * held + ["free list"] * in_free[block_id] + \
                    ["evictable"] * in_lru[block_id]
                found.append(f"block {block_id} is in {n} places, not 1: "
                             f"{', '.join(where) or 'nowhere (leaked)'}")
        if self.prefix_cache is not None:
            found += [f"free-list block {b} is still cached" for b in free
                      if self.prefix_cache.contains_block(b)]
            found += self.prefix_cache.problems()
        if found:
            shown = "\n  ".join(found[:20])
            more = f"\n  ... and {len(found) - 20} more" if len(found) > 20 else ""
            raise KVCacheIntegrityError(f"KV cache integrity check failed ({len(found)} "
                                        f"problems):\n  {shown}{more}")

    def _num_blocks_to_take(self, seq: Sequence, num_new_tokens: int,
                            prefix: CachedPrefix | None) -> int:
        """How many blocks allocating would remove from the free pool."""
        num_held, num_computed, num_revived = len(seq.block_table), seq.num_computed_tokens, 0
        if prefix is not None:
            assert not seq.block_table and seq.num_computed_tokens == 0, "admit a fresh sequence"
            num_held, num_computed = len(prefix.block_ids), prefix.num_tokens
            # cached blocks that nobody holds sit in the free pool: hitting them takes them
            num_revived = sum(1 for b in prefix.block_ids if self.ref_counts[b] == 0)
        num_fresh = max(0, self.num_blocks_for(num_computed + num_new_tokens) - num_held)
        return num_fresh + num_revived

    def _admit_prefix(self, seq: Sequence, prefix: CachedPrefix) -> None:
        for block_id in prefix.block_ids:
            if self.ref_counts[block_id] == 0:
                assert self.prefix_cache is not None
                self.prefix_cache.reclaim(block_id)
            self.ref_counts[block_id] += 1
        seq.block_table.extend(prefix.block_ids)
        seq.block_hashes[:] = prefix.block_hashes
        seq.num_computed_tokens = prefix.num_tokens
        # a recompute after preemption finding its own blocks again is no cache hit
        if seq.first_scheduled_time is None and self.prefix_cache is not None:
            seq.num_cached_tokens = prefix.num_tokens
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += prefix.num_tokens

    def _take_fresh_run(self, n: int, after: int | None) -> list[int]:
        """`n` fresh blocks for a table that ends just before block `after` (None: an
        empty table), as adjacent as the pool allows: decode attention reads a sequence's
        blocks in table order, and on a CPU adjacent blocks come from memory faster than
        scattered ones (1.33-1.43x on a Zen 3; long-context decode steps ~1.1x:
        benchmarks/kernels/kv_adjacency.py).
        Each block is the one after the block taken before it where that one is free;
        the blocks that do not continue the table are put in ascending order (the prefix
        cache's LRU hands out a freed sequence's blocks tail first)."""
        run: list[int] = []
        prefer = after
        for _ in range(n):
            run.append(self._take_fresh_block(prefer))
            prefer = run[-1] + 1
        head = 0  # the blocks that continue the table
        while after is not None and head < n and run[head] == after + head:
            head += 1
        return run[:head] + sorted(run[head:])

    def _hold_back(self, start: int, n: int) -> None:
        """Send the free blocks from `start` on (up to `n`, to the first one not free) to
        the far end of the free list, so that other sequences take them last and the
        sequence whose table ends before `start` can grow into them."""
        for block_id in range(start, start + n):  # past the pool: never free
            if not self._free.hold_back(block_id):
                return

    def _take_fresh_block(self, prefer: int | None = None) -> int:
        """A free block: `prefer` where it is free, else the last freed, else the prefix
        cache's least recently freed (its LRU order is kept: hit rates stay as they were)."""
        if prefer is not None and self._free.take(prefer):  # past the pool: never free
            block_id = prefer
        elif self._free:
            block_id = self._free.pop()
        else:
            assert self.prefix_cache is not None
            evicted = self.prefix_cache.evict()
            assert evicted is not None, "no free block: check can_allocate_slots first"
            block_id = evicted
        self.ref_counts[block_id] = 1
        if not self._touched[block_id]:
            self._touched[block_id] = 1
            self.num_touched_blocks += 1
        return block_id

    def mark_all_touched(self) -> None:
        """The pool was written whole (--kv-cache-prefault)."""
        self._touched = bytearray(b"\x01") * self.num_total_blocks
        self.num_touched_blocks = self.num_total_blocks

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_counts[block_id] == 0:
            if self.prefix_cache is not None and self.prefix_cache.contains_block(block_id):
                self.prefix_cache.release(block_id)
            else:
                self._free.append(block_id)


class FreeList:
    """Free, never-cached blocks in the order they were freed: `pop` takes the last freed,
    `take` any one by id, `hold_back` sends one to the far end. An OrderedDict: O(1)."""

    def __init__(self, blocks: Iterable[int] = ()) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict.fromkeys(blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[int]:
        return iter(self._blocks)

    def append(self, block_id: int) -> None:
        self._blocks[block_id] = None

    def extend(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self.append(block_id)

    def pop(self) -> int:
        return self._blocks.popitem()[0]

    def hold_back(self, block_id: int) -> bool:
        """Make `block_id` the block taken last, if it is free; whether it was."""
        if block_id not in self._blocks:
            return False
        self._blocks.move_to_end(block_id, last=False)
        return True

    def take(self, block_id: int) -> bool:
        """Remove `block_id` if it is free; whether it was."""
        if block_id not in self._blocks:
            return False
        del self._blocks[block_id]
        return True
