"""Prefix cache: chained keys, collision-safe lookup, LRU of idle cached blocks."""

from tokenmill.kvcache import prefix_cache as pc
from tokenmill.kvcache.prefix_cache import ROOT_HASH, PrefixCache, hash_block


def test_same_tokens_after_a_different_prefix_is_a_different_key():
    first = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) == first
    assert hash_block(first, [5, 6]) != hash_block(hash_block(ROOT_HASH, [9, 9, 9, 9]), [5, 6])


def test_lookup_finds_the_registered_block():
    cache = PrefixCache()
    h = cache.insert(7, ROOT_HASH, [1, 2])
    assert cache.lookup(ROOT_HASH, [1, 2]) == (h, 7)
    assert cache.lookup(ROOT_HASH, [1, 3])[1] is None
    assert cache.lookup(h, [1, 2])[1] is None  # same tokens, other position in the chain


def test_hash_collision_never_returns_another_prefix(monkeypatch):
    monkeypatch.setattr(pc, "hash_block", lambda parent, tokens: 42)
    cache = PrefixCache()
    assert cache.insert(0, ROOT_HASH, [1, 2]) == 42
    assert cache.insert(1, ROOT_HASH, [3, 4]) is None  # colliding content is not registered
    assert cache.lookup(ROOT_HASH, [3, 4]) == (42, None)
    assert cache.lookup(ROOT_HASH, [1, 2]) == (42, 0)
    assert cache.lookup(5, [1, 2]) == (42, None)  # same tokens, wrong parent


def test_evicts_least_recently_released_first_and_reclaim_protects():
    cache = PrefixCache()
    for block_id in range(3):
        cache.insert(block_id, ROOT_HASH, [block_id])
        cache.release(block_id)
    assert cache.reclaim(0)  # a hit takes block 0 back out of the LRU
    assert not cache.reclaim(0)
    assert cache.evict() == 1
    assert cache.lookup(ROOT_HASH, [1])[1] is None  # evicted blocks are forgotten
    assert cache.evict() == 2
    assert cache.evict() is None
    assert cache.lookup(ROOT_HASH, [0])[1] == 0


def test_reset_forgets_everything_and_returns_idle_blocks():
    cache = PrefixCache()
    cache.insert(0, ROOT_HASH, [1])
    cache.insert(1, ROOT_HASH, [2])
    cache.release(1)
    assert cache.reset() == [1]
    assert len(cache) == 0 and cache.num_evictable == 0
    assert cache.lookup(ROOT_HASH, [1])[1] is None
