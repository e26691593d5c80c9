"""check_integrity(): the block manager's books agree after real use, and each
kind of corruption (a ref count, the free list, a hash entry) is caught."""

import pytest

from tests.unit.test_block_manager import admit, compute_all, make_seq
from tokenmill.kvcache.block_manager import BlockManager, KVCacheIntegrityError


@pytest.fixture
def busy():
    """Two live sequences sharing a cached prefix block, one finished sequence
    whose cached blocks wait in the LRU, and plain free blocks."""
    bm = BlockManager(num_blocks=12, block_size=4)
    done = make_seq(range(200, 209))
    admit(bm, done)
    compute_all(bm, done)
    bm.free(done)  # 2 full blocks stay cached, evictable
    a, b = make_seq([1, 2, 3, 4, 5, 6]), make_seq([1, 2, 3, 4, 7, 8, 9])
    for seq in (a, b):
        admit(bm, seq)
        compute_all(bm, seq)
    assert a.block_table[0] == b.block_table[0]  # the prefix hit: a shared block
    live = [a, b]
    bm.check_integrity(live)
    return bm, live


def test_a_wrong_ref_count_is_caught(busy):
    bm, live = busy
    shared = live[0].block_table[0]
    bm.ref_counts[shared] -= 1  # one holder forgotten: freeing both would free it twice
    with pytest.raises(KVCacheIntegrityError,
                       match=f"block {shared} has ref count 1 but 2 live sequences hold it"):
        bm.check_integrity(live)


def test_a_corrupted_free_list_is_caught(busy):
    bm, live = busy
    held = live[1].block_table[-1]
    bm._free.append(held)  # a held block handed out again would be overwritten
    with pytest.raises(KVCacheIntegrityError, match=f"block {held} is in 2 places"):
        bm.check_integrity(live)
    bm._free.take(held)
    lost = bm._free.pop()  # a block in no list at all is a leak
    with pytest.raises(KVCacheIntegrityError, match=f"block {lost} .*nowhere \\(leaked\\)"):
        bm.check_integrity(live)


def test_a_corrupted_hash_entry_is_caught(busy):
    bm, live = busy
    cache = bm.prefix_cache
    block_hash, block_id = next(iter(cache._block_by_hash.items()))
    cache._block_by_hash[block_hash] = (block_id + 1) % bm.num_total_blocks
    with pytest.raises(KVCacheIntegrityError, match=f"hash {block_hash:#x} points at block"):
        bm.check_integrity(live)


def test_a_sequence_hash_that_does_not_match_its_tokens_is_caught(busy):
    bm, live = busy
    live[0].token_ids[0] = 99  # its registered first block no longer holds these tokens
    with pytest.raises(KVCacheIntegrityError, match="hash of block 0 does not match"):
        bm.check_integrity(live)


def test_no_live_sequences_means_every_block_is_free(busy):
    bm, live = busy
    with pytest.raises(KVCacheIntegrityError, match="live sequences hold it"):
        bm.check_integrity([])  # a sequence dropped without free(): its blocks leaked
    for seq in live:
        bm.free(seq)
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_total_blocks
