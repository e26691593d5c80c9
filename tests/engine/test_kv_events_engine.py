"""KV events from a real engine over ZMQ, decoded as a vLLM consumer decodes them."""

import time

import pytest
import zmq

from tests.unit import vllm_kv_events as vllm
from tokenmill import LLM, SamplingParams


def _receive_all(sub: zmq.Socket, idle_s: float = 0.5) -> list[tuple[bytes, int, vllm.KVEventBatch]]:
    out = []
    while sub.poll(int(idle_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), vllm.decoder.decode(payload)))
    return out


@pytest.fixture(scope="module")
def events_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv") / "events"
    endpoint, replay = f"ipc://{path}", f"ipc://{path}-replay"
    llm = LLM("smollm2-135m", num_kv_blocks=12, max_num_seqs=4,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": endpoint, "replay_endpoint": replay,
                                "topic": "kv"})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    time.sleep(0.3)  # a PUB drops what is sent before the subscription arrives
    yield llm, sub, replay
    sub.close(linger=0)
    llm.engine.close()


def test_a_request_is_announced_block_by_block_and_evicted_blocks_are_removed(events_llm):
    llm, sub, _ = events_llm
    prompt = list(range(1000, 1040))  # 2 full blocks of 16 + 8 tokens
    out = llm.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True),
                       use_tqdm=False)[0]
    tokens = prompt + out.outputs[0].token_ids  # 70 tokens: 4 full blocks were hashed
    received = _receive_all(sub)
    assert received and all(topic == b"kv" for topic, _, _ in received)
    seqs = [s for _, s, _ in received]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    stored = [e for _, _, b in received for e in b.events if isinstance(e, vllm.BlockStored)]
    # follow the parent links from the root: they spell out the sequence's full blocks
    chain, parent = [], None
    by_parent = {e.parent_block_hash: e for e in stored}
    while parent in by_parent:
        event = by_parent[parent]
        chain.extend(event.token_ids)
        parent = event.block_hashes[-1]
    assert chain == tokens[:64]
    first_hashes = [h for e in stored for h in e.block_hashes]

    # 12 blocks: three other 70-token requests need them all, so the first one's go
    for i in range(3):
        llm.generate([list(range(2000 + 100 * i, 2040 + 100 * i))],
                     SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
    later = _receive_all(sub)
    assert later[0][1] > seqs[-1]
    removed = {h for _, _, b in later for e in b.events if isinstance(e, vllm.BlockRemoved)
               for h in e.block_hashes}
    assert set(first_hashes) <= removed


def test_the_replay_socket_resends_from_a_sequence_number(events_llm):
    llm, sub, replay = events_llm
    llm.generate([list(range(3000, 3040))], SamplingParams(max_tokens=1), use_tqdm=False)
    live = _receive_all(sub)
    assert live
    # a DEALER, not a REQ: the ROUTER streams several replies to one request
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.connect(replay)
    start = live[0][1]
    req.send_multipart((b"", start.to_bytes(8, "big")))
    replayed = []
    while True:
        assert req.poll(5000), "no replay answer"
        _, seq, payload = req.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            assert payload == b""
            break
        assert vllm.decoder.decode(payload).events
        replayed.append(int.from_bytes(seq, "big"))
    req.close(linger=0)
    assert replayed[0] == start and replayed == sorted(replayed)
