"""KV events: what the prefix cache records, and the bytes a vLLM consumer decodes."""

import msgspec
import pytest

from tests.unit import vllm_kv_events as vllm
from tokenmill.config import CacheConfig, KVEventsConfig
from tokenmill.kvcache.block_manager import BlockManager
from tokenmill.kvcache.events import KVEventBatch, KVEventRecorder
from tokenmill.lora_request import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence

BS = 4
U64 = (1 << 64) - 1


def _manager(num_blocks: int = 8) -> tuple[BlockManager, KVEventRecorder]:
    bm = BlockManager(num_blocks, BS)
    recorder = KVEventRecorder(BS)
    bm.prefix_cache.events = recorder
    return bm, recorder


def _run(bm: BlockManager, seq_id: str, tokens: list[int],
         lora: LoRARequest | None = None) -> Sequence:
    seq = Sequence(seq_id, tokens, SamplingParams(max_tokens=1))
    seq.lora_request = lora
    prefix = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, len(tokens) - prefix.num_tokens, prefix)
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq)
    return seq


def _decode(events) -> vllm.KVEventBatch:
    return vllm.decoder.decode(msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=events)))


def test_a_prompts_full_blocks_are_one_stored_chain_vllm_decodes():
    bm, rec = _manager()
    tokens = list(range(100, 111))  # 2 full blocks of 4 + 3 tokens
    seq = _run(bm, "a", tokens)
    batch = _decode(rec.take())
    assert len(batch.events) == 1
    stored = batch.events[0]
    assert isinstance(stored, vllm.BlockStored)
    assert stored.token_ids == tokens[:8] and stored.block_size == BS
    assert stored.parent_block_hash is None  # a first block has no parent
    assert stored.block_hashes == [h & U64 for h in seq.block_hashes]
    assert rec.take() == []  # taken once


def test_a_continuation_names_its_parent_and_a_shared_prefix_is_not_stored_twice():
    bm, rec = _manager()
    first = _run(bm, "a", list(range(8)) + [99])
    rec.take()
    second = _run(bm, "b", list(range(8)) + [50, 51, 52, 53, 54])  # hits 2 blocks, adds 1
    (stored,) = _decode(rec.take()).events
    assert stored.token_ids == [50, 51, 52, 53]
    assert first.block_hashes[-1] == second.block_hashes[1]
    assert stored.parent_block_hash == first.block_hashes[-1] & U64
    assert stored.block_hashes == [h & U64 for h in second.block_hashes[2:]]


def test_an_adapters_blocks_name_it_and_its_first_block_has_no_parent_as_in_vllm():
    bm, rec = _manager()
    base = _run(bm, "base", list(range(9)))
    assert _decode(rec.take()).events[0].lora_id is None
    sql = LoRARequest("sql", 3, "/adapters/sql")
    first = _run(bm, "a", list(range(9)), sql)  # the base's prompt: no hit, its own chain
    (stored,) = _decode(rec.take()).events
    assert (stored.lora_id, stored.lora_name) == (3, "sql")
    # vLLM sends None for the first block of every chain, an adapter's included: the
    # adapter's root hash is private, and a consumer has never seen it stored
    assert stored.parent_block_hash is None
    assert stored.extra_keys == [("sql",), ("sql",)]  # vLLM's per-block untagged lora key
    assert set(stored.block_hashes).isdisjoint(h & U64 for h in base.block_hashes)
    second = _run(bm, "b", list(range(8)) + [70, 71, 72, 73, 74], sql)  # hits 2, adds 1
    (more,) = _decode(rec.take()).events
    assert more.parent_block_hash == first.block_hashes[-1] & U64  # seen in `stored`
    assert more.block_hashes == [second.block_hashes[2] & U64]
    assert (more.lora_id, more.lora_name, more.extra_keys) == (3, "sql", [("sql",)])


def test_stores_of_two_adapters_in_one_step_are_two_events():
    bm, rec = _manager()
    _run(bm, "a", list(range(5)), LoRARequest("a", 1))
    _run(bm, "b", list(range(100, 105)), LoRARequest("b", 2))
    _run(bm, "c", list(range(200, 205)))
    events = _decode(rec.take()).events
    assert [(e.lora_name, e.parent_block_hash) for e in events] == [
        ("a", None), ("b", None), (None, None)]
    assert events[2].extra_keys is None


def test_eviction_is_block_removed_and_reset_is_all_blocks_cleared():
    bm, rec = _manager(num_blocks=3)
    seq = _run(bm, "a", list(range(9)))  # 2 full blocks + 1 partial: all 3 blocks
    hashes = [h & U64 for h in seq.block_hashes]
    bm.free(seq)
    rec.take()
    bm.free(_run(bm, "b", list(range(200, 209))))  # needs all 3 blocks: evicts both
    events = _decode(rec.take()).events
    removed = [e for e in events if isinstance(e, vllm.BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(hashes)
    assert isinstance(events[-1], vllm.BlockStored)  # b's own blocks, after the evictions
    bm.reset_prefix_cache()
    assert [type(e) for e in _decode(rec.take()).events] == [vllm.AllBlocksCleared]


def test_wire_shape_is_an_array_batch_of_tagged_maps():
    bm, rec = _manager()
    _run(bm, "a", list(range(5)))
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(
        KVEventBatch(ts=2.5, events=rec.take(), data_parallel_rank=0)))
    ts, events, rank = raw
    assert ts == 2.5 and rank == 0
    (event,) = events
    hashes = event.pop("block_hashes")
    assert len(hashes) == 1 and 0 <= hashes[0] <= U64  # vllm-router takes unsigned only
    assert event == {"type": "BlockStored", "parent_block_hash": None,
                     "token_ids": [0, 1, 2, 3], "block_size": BS, "lora_id": None,
                     "medium": None, "lora_name": None}


def test_config_is_vllms():
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:1"}')
    assert cfg.publisher == "zmq" and cfg.active
    assert not KVEventsConfig().active
    with pytest.raises(ValueError, match="unknown field"):
        KVEventsConfig.from_json('{"enable_kv_cache_event": true}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig(enable_kv_cache_events=True, publisher="kafka")
    with pytest.raises(ValueError, match="prefix caching"):
        CacheConfig(enable_prefix_caching=False, kv_events=cfg)
