"""Block manager: allocation, ref counts, prefix hits, LRU eviction, check-then-commit."""

import pytest

from tokenmill.kvcache import prefix_cache
from tokenmill.kvcache.block_manager import BlockManager
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence


def make_seq(tokens, request_id="r"):
    return Sequence(request_id, list(tokens), SamplingParams(max_tokens=8))


def admit(bm, seq):
    """Admit like the scheduler does: prefix lookup, then slots for the rest."""
    prefix = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - prefix.num_tokens, prefix)
    return prefix


def compute_all(bm, seq):
    """What the scheduler's post-step update does once the prompt has run."""
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_allocate_free_round_trip_leaves_every_block_free():
    bm = BlockManager(num_blocks=10, block_size=4)
    seqs = [make_seq(range(100 * n, 100 * n + n)) for n in (1, 4, 5, 9)]  # no shared prefix
    for seq in seqs:
        admit(bm, seq)
        compute_all(bm, seq)
    assert [len(s.block_table) for s in seqs] == [1, 1, 2, 3]
    assert bm.num_free_blocks == 10 - 7
    assert bm.usage == pytest.approx(0.7)
    for seq in seqs:
        bm.free(seq)
        assert seq.block_table == []
    assert bm.num_free_blocks == bm.num_total_blocks == 10
    assert bm.usage == 0.0
    assert bm.ref_counts == [0] * 10


def test_requests_one_after_another_reuse_the_same_blocks():
    """A freed block is the next one taken, so the pool's memory in use (and RSS: the pool
    is touched lazily) stays at the peak demand instead of creeping through every block."""
    bm = BlockManager(num_blocks=100, block_size=4, enable_prefix_caching=False)
    for n in range(20):
        seq = make_seq(range(100 * n, 100 * n + 10))  # 3 blocks each
        admit(bm, seq)
        bm.free(seq)
    assert bm.num_touched_blocks == 3
    first = make_seq(range(8))
    admit(bm, first)
    assert first.block_table == [0, 1]  # the blocks just freed, in their order


def test_slots_grow_one_block_at_a_time_in_decode():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(range(4))
    admit(bm, seq)
    compute_all(bm, seq)
    seq.append_token(99)
    assert bm.allocate_slots(seq, 1)  # the 5th token opens a second block
    assert len(seq.block_table) == 2
    seq.num_computed_tokens += 1
    seq.append_token(98)
    assert bm.allocate_slots(seq, 1)  # the 6th fits in the same block
    assert len(seq.block_table) == 2
    # slot of a position: block_table[p // block_size] * block_size + p % block_size
    assert len(set(seq.block_table)) == 2


def test_shared_prefix_is_ref_counted():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(21))  # 5 full blocks + 1 token
    a, b = make_seq(prompt, "a"), make_seq(prompt, "b")
    admit(bm, a)
    compute_all(bm, a)
    admit(bm, b)
    assert b.block_table[:5] == a.block_table[:5]
    assert b.block_table[5] != a.block_table[5]
    assert [bm.ref_counts[x] for x in a.block_table] == [2] * 5 + [1]
    assert bm.num_free_blocks == 16 - 7
    bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_table] == [1] * 6
    assert bm.num_free_blocks == 16 - 6  # shared blocks stay in use for b
    bm.free(b)
    assert bm.num_free_blocks == 16 and not any(bm.ref_counts)


def test_cannot_allocate_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(range(17))  # needs 5 blocks
    assert not bm.can_allocate_slots(seq, 17, bm.get_computed_blocks(seq))
    assert not bm.allocate_slots(seq, 17, bm.get_computed_blocks(seq))
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 4 and not any(bm.ref_counts)


def test_failed_admission_with_prefix_hit_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(9))
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)  # 2 cached idle blocks + 2 plain free blocks
    b = make_seq(list(range(8)) + list(range(100, 112)))  # hits 2 blocks, needs 3 more
    prefix = bm.get_computed_blocks(b)
    assert prefix.num_tokens == 8
    assert not bm.allocate_slots(b, b.num_tokens - 8, prefix)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert bm.num_free_blocks == 4 and not any(bm.ref_counts)
    assert bm.prefix_cache_queries == 9  # only a's admission counted
    assert bm.get_computed_blocks(make_seq(range(9))).num_tokens == 8  # still cached


@pytest.mark.parametrize("extra, expected_hit_blocks", [(0, 4), (3, 5)])
def test_second_request_with_same_5_block_prefix_hits(extra, expected_hit_blocks):
    bm = BlockManager(num_blocks=32, block_size=16)
    prompt = list(range(1000, 1080)) + list(range(extra))  # 5 blocks (+ extra tokens)
    first = make_seq(prompt)
    assert admit(bm, first).num_tokens == 0
    compute_all(bm, first)
    first_blocks = list(first.block_table)
    bm.free(first)  # hits also work after the first request finished
    second = make_seq(prompt)
    admit(bm, second)
    # a prompt of exactly 5 blocks still computes its last block, to get logits
    assert second.num_computed_tokens == second.num_cached_tokens == 16 * expected_hit_blocks
    assert second.block_table[:expected_hit_blocks] == first_blocks[:expected_hit_blocks]
    assert bm.prefix_cache_hits == 16 * expected_hit_blocks
    assert bm.prefix_cache_queries == 2 * len(prompt)


def test_hash_collision_is_a_miss_not_a_wrong_hit(monkeypatch):
    monkeypatch.setattr(prefix_cache, "hash_block", lambda parent, tokens: 7)
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    compute_all(bm, a)
    b = make_seq([8, 9, 3, 4, 5])  # same key for every block, different tokens
    admit(bm, b)
    assert b.num_computed_tokens == 0 and bm.prefix_cache_hits == 0
    c = make_seq([1, 2, 3, 4, 5])  # genuinely equal first block still hits
    admit(bm, c)
    assert c.num_computed_tokens == 2


def test_lru_evicts_least_recently_freed_cached_block_and_plain_blocks_first():
    bm = BlockManager(num_blocks=5, block_size=2)
    a, b = make_seq([1, 2, 3, 4]), make_seq([5, 6, 7, 8])
    for seq in (a, b):
        admit(bm, seq)
        compute_all(bm, seq)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 5
    # one never-cached block is free: it is used before any cached block is evicted
    filler = make_seq([40])
    admit(bm, filler)
    assert filler.block_table[0] not in a_blocks + b_blocks
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 4, 0])).num_tokens == 4
    # next fresh block evicts a's tail (a was freed first; a sequence frees tail first)
    other = make_seq([50])
    admit(bm, other)
    assert other.block_table == [a_blocks[1]]
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 4, 0])).num_tokens == 2
    assert bm.get_computed_blocks(make_seq([5, 6, 7, 8, 0])).num_tokens == 4
    another = make_seq([60])
    admit(bm, another)
    assert another.block_table == [a_blocks[0]]
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 4, 0])).num_tokens == 0
    assert bm.get_computed_blocks(make_seq([5, 6, 7, 8, 0])).block_ids == b_blocks


def test_hit_on_an_idle_cached_block_takes_it_out_of_the_free_pool():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 5])
    admit(bm, b)
    assert b.num_computed_tokens == 4
    assert bm.num_free_blocks == 4 - 3
    other = make_seq([9, 9, 9])  # needs 2 blocks, only 1 free: must not evict b's hits
    assert not bm.can_allocate_slots(other, 3, bm.get_computed_blocks(other))


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    prompt = [1, 2, 3, 4, 5]
    a = make_seq(prompt)
    admit(bm, a)
    compute_all(bm, a)
    b = make_seq(prompt)
    admit(bm, b)
    assert b.num_computed_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)
    bm.free(a)
    bm.free(b)
    c = make_seq(prompt)
    admit(bm, c)
    assert c.num_computed_tokens == 0
    assert bm.prefix_cache_queries == bm.prefix_cache_hits == 0


def test_reset_prefix_cache_forgets_hits_and_frees_idle_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_free_blocks == 4
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 4, 5])).num_tokens == 0
    assert bm.prefix_cache_queries == bm.prefix_cache_hits == 0


def test_free_slots_beyond_rolls_back_speculative_slots():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(6))
    admit(bm, seq)
    compute_all(bm, seq)
    assert bm.allocate_slots(seq, 7)  # 6 + 7 draft slots -> 4 blocks
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    bm.free_slots_beyond(seq, 9)  # 3 of 7 accepted
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8


def test_max_tokens_that_fit():
    assert BlockManager(num_blocks=10, block_size=16).max_tokens_that_fit() == 160


def test_a_growing_sequence_takes_the_block_after_its_last_where_that_is_free():
    """Decode attention reads a table's blocks in order, and adjacent blocks come from
    memory faster: an admitted sequence's next blocks (as many as its max_tokens may
    need) are taken by others only when nothing else is free, and a sequence that grows
    takes the block after its last one, not the last freed."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b, c = (make_seq(range(100 * n, 100 * n + size)) for n, size in ((1, 8), (2, 4), (3, 4)))
    for seq in (a, b, c):  # max_tokens 8: two more blocks each, at most
        admit(bm, seq)
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [4], [7])
    a.num_computed_tokens = a.num_tokens
    assert bm.allocate_slots(a, 8)
    assert a.block_table == [0, 1, 2, 3]
    d = make_seq(range(400, 408))  # only b's room is left: it is handed out, not refused
    admit(bm, d)
    assert sorted(d.block_table) == [5, 6]
    for seq in (a, b, c, d):
        bm.free(seq)
    bm.check_integrity([])


def test_blocks_the_lru_hands_out_are_in_ascending_order_and_continue_the_table():
    """The LRU gives back a freed sequence's blocks tail first; a step's fresh blocks are
    put in ascending order after those that continue the table."""
    bm = BlockManager(num_blocks=6, block_size=4)
    old = make_seq(range(1000, 1024))  # 6 full blocks: all cached when freed
    admit(bm, old)
    compute_all(bm, old)
    assert old.block_table == [0, 1, 2, 3, 4, 5]
    bm.free(old)
    assert bm.prefix_cache.evictable_blocks == [5, 4, 3, 2, 1, 0]
    new = make_seq(range(2000, 2016))  # a miss: 4 blocks evicted, least recently freed first
    admit(bm, new)
    assert new.block_table == [2, 3, 4, 5]
    new.num_computed_tokens = new.num_tokens
    assert bm.allocate_slots(new, 8)  # block 6 is past the pool: the LRU's next two
    assert new.block_table == [2, 3, 4, 5, 0, 1]
    bm.check_integrity([new])
