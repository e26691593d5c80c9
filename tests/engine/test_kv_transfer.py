"""Issue 62: prefill/decode disaggregation between two engines of the embedded model.
A prefill engine (kv_producer) runs each prompt for one token and pins its blocks; a
decode engine (kv_consumer) pulls them and continues: greedy output identical to one
engine doing both, with fp32 and with the default dtype + int8 KV; bad pulls fall
back to prefilling locally; no block leaks on either side."""

from __future__ import annotations

import pytest
import zmq

from tests.engine.conftest import assert_no_leak
from tokenmill.config import CacheConfig, EngineConfig, KVTransferConfig
from tokenmill.engine.core.llm_engine import LLMEngine
from tokenmill.engine.core.validation import RequestError
from tokenmill.kvcache.transfer.transport import Puller, TransferError
from tokenmill.kvcache.transfer.wire import PullRequest
from tokenmill.sampling_params import SamplingParams

PROMPTS = ["The capital of France is",
           "Write a haiku about the sea and the stars over the harbour, with care",
           "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17",  # ends exactly on a block edge?
           "def fibonacci(n):\n    ",
           "Explain why the sky is blue in one sentence.",
           "Translate to French: The cat sleeps on the warm windowsill.",
           "List three uses of a paperclip:",
           "Q: What is 17 times 3?\nA:",
           "The quick brown fox jumps over the lazy dog. The quick brown fox",
           "import numpy as np\n\ndef normalize(x):\n",
           "Dear team,\n\nI am writing to let you know that",
           "A short story about a robot who learns to paint:",
           "The three primary colors are",
           "Summarize: Photosynthesis turns light, water and carbon dioxide into sugar.",
           "In 1969, the first humans",
           "SELECT name, age FROM users WHERE",
           "Recipe for pancakes. Ingredients:",
           "The mitochondria is",
           ("Why do leaves change color in autumn? Give a careful, detailed answer for a child "
            "who is seven years old and loves trees."),
           "Monday, Tuesday, Wednesday,",
           "<html>\n<head>\n<title>",
           "The best way to learn a new language is",
           "Write a limerick about a cat named Pat.",
           ("Once upon a time, in a quiet village by the river, there lived an old miller who "
            "had three sons and a single grey donkey"),
           "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
           "Water boils at",
           "A B C D E F G H I J K L M N O P",
           "My favourite book is",
           "Compare cats and dogs as pets:",
           "The Pythagorean theorem states that",
           "Hello! How are you today?",
           "Rules of chess: the knight moves",
           ]  # the 32: short and multi-block, text and code
NEW_TOKENS = 12


def _engine(role: str, dtype: str, kv_cache_dtype: str, **transfer) -> LLMEngine:
    # all 32 prompts in one batch (see _decode), and room for every prompt's pinned
    # blocks at once (fp32 KV: 46 KiB a token)
    return LLMEngine(EngineConfig(max_num_seqs=32, dtype=dtype, cache=CacheConfig(
        kv_cache_memory_bytes=96 * 2**20, kv_cache_dtype=kv_cache_dtype,
        kv_transfer=KVTransferConfig(kv_role=role, **transfer))))


CONFIGS = {"fp32": ("float32", "auto"), "default-dtype-int8-kv": ("auto", "int8")}


@pytest.fixture(scope="module")
def pairs():
    """(producer, consumer) per CONFIGS key, built on first use, closed at the end."""
    built: dict[str, tuple[LLMEngine, LLMEngine]] = {}

    def get(key: str) -> tuple[LLMEngine, LLMEngine]:
        if key not in built:
            dtype, kv = CONFIGS[key]
            built[key] = (_engine("kv_producer", dtype, kv, pin_timeout_s=30),
                          _engine("kv_consumer", dtype, kv, pull_timeout_s=5))
        return built[key]

    yield get
    for producer, consumer in built.values():
        producer.close()
        consumer.close()


@pytest.fixture
def pair(pairs):
    """The faster pair (bf16 weights' path, int8 KV) for the bad-input tests."""
    return pairs("default-dtype-int8-kv")


def _run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    # every pull landed before the first step: all requests are installed together and
    # decode in the same batches as the one-engine reference, whose prompts are one
    # prefill step (the default-dtype path is not batch-invariant: a batch of 4 and of
    # 32 give different greedy tokens for the same prompt on one engine)
    while engine.kv_transfer.pulls_in_flight():
        engine.kv_transfer.wait_for_pull(0.05)
    finals = {}
    while engine.requests:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def _prefill(producer: LLMEngine, tag: str, prompts=PROMPTS) -> dict[int, dict]:
    outs = _run(producer, {f"{tag}-p{i}": (p, SamplingParams(
        max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True}))
        for i, p in enumerate(prompts)})
    return {i: outs[f"{tag}-p{i}"].kv_transfer_params for i in range(len(prompts))}


def _decode(consumer: LLMEngine, tag: str, params: dict[int, dict | None],
            prompts=PROMPTS) -> dict[int, list[int]]:
    outs = _run(consumer, {f"{tag}-d{i}": (p, SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, kv_transfer_params=params.get(i)))
        for i, p in enumerate(prompts)})
    return {i: outs[f"{tag}-d{i}"].outputs[0].token_ids for i in range(len(prompts))}


def _drain_pins(producer: LLMEngine) -> None:
    """The producer frees served pins on its next step (the engine loop keeps stepping
    while pins are held: has_unfinished_requests)."""
    for _ in range(3):
        producer.step()


@pytest.mark.parametrize("key", list(CONFIGS))
def test_pd_greedy_output_equals_one_engine(pairs, key):
    producer, consumer = pairs(key)
    reference = _decode(consumer, "ref", {})  # one engine: prefill and decode
    received = consumer.stats.kv_transfer_received_tokens
    params = _prefill(producer, "a")
    assert all(p["remote_port"] and p["remote_block_ids"] for p in params.values())
    got = _decode(consumer, "a", params)
    _drain_pins(producer)
    assert got == reference
    n_prompt = sum(len(consumer.tokenizer.encode(p)) for p in PROMPTS)
    assert consumer.stats.kv_transfer_received_tokens - received == n_prompt
    assert consumer.stats.kv_transfer_fallbacks == 0
    assert_no_leak(producer)
    assert_no_leak(consumer)
    # pulled blocks are registered under the prefix cache's hashes: a prompt this engine
    # never computed itself hits them afterwards
    fresh = ["A fresh prompt, never computed by the decode engine: " + " ".join(
        f"word{i}" for i in range(24))]
    _decode(consumer, "h", _prefill(producer, "h", fresh), fresh)
    _drain_pins(producer)
    hits = consumer.block_manager.prefix_cache_hits
    _decode(consumer, "h2", {}, fresh)
    n_fresh = len(consumer.tokenizer.encode(fresh[0]))
    assert consumer.block_manager.prefix_cache_hits - hits == (n_fresh - 1) // 16 * 16 > 0
    assert consumer.stats.kv_transfer_fallbacks == 0


def test_unknown_request_falls_back_and_leaks_nothing(pair):
    producer, consumer = pair
    params = _prefill(producer, "u", PROMPTS[:1])
    bad = dict(params[0], remote_request_id="nobody")
    got = _decode(consumer, "u", {0: bad}, PROMPTS[:1])
    reference = _decode(consumer, "uref", {}, PROMPTS[:1])
    assert got == reference  # prefilled locally instead
    assert consumer.stats.kv_transfer_fallbacks >= 1
    for entry in producer.kv_transfer.holders():  # never pulled: the pin timeout frees it
        entry.deadline = 0
    _drain_pins(producer)
    assert_no_leak(producer)
    assert_no_leak(consumer)


def test_unknown_request_is_named_by_the_producer(pair):
    producer, consumer = pair
    layout = consumer.kv_transfer.consumer.layout
    port = producer.kv_transfer.server.port
    with pytest.raises(TransferError, match="unknown request 'nobody'"):
        Puller(zmq.Context.instance()).pull("127.0.0.1", port,
                                            PullRequest("nobody", [1], layout), 5, [], layout)


def test_layout_mismatch_is_refused_naming_the_field(pair):
    producer, consumer = pair
    params = _prefill(producer, "m", PROMPTS[:1])[0]
    layout = consumer.kv_transfer.consumer.layout
    wrong = type(layout)(**{**{f: getattr(layout, f) for f in layout.__struct_fields__},
                            "block_size": layout.block_size * 2})
    with pytest.raises(TransferError, match="mismatch in block_size"):
        Puller(zmq.Context.instance()).pull(
            "127.0.0.1", params["remote_port"],
            PullRequest(params["remote_request_id"], params["remote_block_ids"], wrong),
            5, [], wrong)
    _drain_pins(producer)  # a refused pull frees the pin at once
    assert_no_leak(producer)


def test_truncated_transfer_is_refused(pair):
    producer, consumer = pair
    params = _prefill(producer, "t", PROMPTS[:1])[0]
    layout = consumer.kv_transfer.consumer.layout
    sizes = [1] * (4 * layout.num_layers)  # what a shorter frame set would be
    with pytest.raises(TransferError, match="truncated transfer"):
        Puller(zmq.Context.instance()).pull(
            "127.0.0.1", params["remote_port"],
            PullRequest(params["remote_request_id"], params["remote_block_ids"], layout),
            5, sizes, layout)
    _drain_pins(producer)
    assert_no_leak(producer)


def test_a_dead_producer_times_out_into_a_local_prefill(pair):
    _, consumer = pair
    with zmq.Context.instance().socket(zmq.ROUTER) as silent:  # takes pulls, never answers
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        consumer.kv_transfer.consumer.pull_timeout_s = 0.5
        try:
            params = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                      "remote_port": port, "remote_request_id": "x", "remote_block_ids": [0],
                      "first_token_id": 5}
            fallbacks = consumer.stats.kv_transfer_fallbacks
            got = _decode(consumer, "dead", {0: params}, PROMPTS[:1])
        finally:
            consumer.kv_transfer.consumer.pull_timeout_s = 5
    assert got == _decode(consumer, "deadref", {}, PROMPTS[:1])
    assert consumer.stats.kv_transfer_fallbacks == fallbacks + 1
    assert_no_leak(consumer)


def test_abort_while_pulling_frees_both_sides(pair):
    """A client that leaves before its blocks arrive: nothing is allocated on the
    decode side, and the producer drops its pin at its next step after the consumer's
    release is answered (whether the release or the pull reached it first), not at
    pin_timeout_s."""
    producer, consumer = pair
    params = _prefill(producer, "x", PROMPTS[:1])[0]
    expired = producer.kv_transfer.producer.num_expired
    assert producer.block_manager.num_free_blocks < producer.block_manager.num_total_blocks
    consumer.add_request("x-d", PROMPTS[0], SamplingParams(
        max_tokens=4, temperature=0, kv_transfer_params=params))
    consumer.abort_request("x-d")
    assert_no_leak(consumer)
    consumer.kv_transfer.consumer.drain_releases()
    producer.step()
    assert_no_leak(producer)
    assert producer.kv_transfer.producer.num_expired == expired  # not the timeout


def test_a_release_drops_the_pin_at_the_next_step(pair):
    """The release message itself: the pin goes at the producer's next step, a second
    release finds nothing, and a pull after it is refused by name."""
    producer, consumer = pair
    params = _prefill(producer, "r", PROMPTS[:1])[0]
    puller = Puller(zmq.Context.instance())
    port, rid = params["remote_port"], params["remote_request_id"]
    released = producer.kv_transfer.producer.num_released
    try:
        assert puller.release("127.0.0.1", port, rid, 5) is True
        producer.step()
        assert_no_leak(producer)
        assert producer.kv_transfer.producer.num_released == released + 1
        assert puller.release("127.0.0.1", port, rid, 5) is False
        layout = consumer.kv_transfer.consumer.layout
        with pytest.raises(TransferError, match="already pulled or released"):
            puller.pull("127.0.0.1", port, PullRequest(rid, params["remote_block_ids"],
                                                        layout), 5, [], layout)
        assert puller.num_connects == 1  # one kept connection for all three messages
    finally:
        puller.close()


@pytest.mark.parametrize("params, field", [
    ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 1,
      "remote_block_ids": [0], "first_token_id": 1}, "kv_transfer_params.remote_request_id"),
    ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 1,
      "remote_request_id": "r", "remote_block_ids": [0], "first_token_id": 10**9},
     "kv_transfer_params.first_token_id"),
    ({"do_remote_decode": True}, "kv_transfer_params"),  # the consumer is no producer
])
def test_bad_kv_transfer_params_name_the_field(pair, params, field):
    _, consumer = pair
    with pytest.raises(RequestError) as e:
        consumer.add_request("bad", "hi", SamplingParams(max_tokens=1,
                                                         kv_transfer_params=params))
    assert e.value.param == field
    assert "bad" not in consumer.requests


def test_a_prefill_request_needs_max_tokens_1(pair):
    producer, _ = pair
    with pytest.raises(RequestError) as e:
        producer.add_request("bad", "hi", SamplingParams(
            max_tokens=5, kv_transfer_params={"do_remote_decode": True}))
    assert e.value.param == "max_tokens"


@pytest.mark.parametrize("raw, words", [
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}', "Mooncake"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}', "NIXL"),
    ('{"kv_connector": "Foo", "kv_role": "kv_producer"}', "unknown kv_connector 'Foo'"),
    ('{"kv_role": "producer"}', "kv_role must be one of"),
    ('{"kv_connector": "ZmqConnector"}', "kv_role is required"),
    ('{"kv_role": "kv_both", "kv_port": 70000}', "kv_port"),
    ('{"kv_role": "kv_both", "color": 1}', "unknown field(s) color"),
])
def test_kv_transfer_config_errors_name_the_field(raw, words):
    with pytest.raises((ValueError, TypeError), match=words.replace("(", r"\(")
                       .replace(")", r"\)")):
        KVTransferConfig.from_json(raw)


def test_sliding_window_models_are_refused():
    """Gemma 3's shape (checked before any connector is built: no model load needed)."""
    from tokenmill.config import ModelConfig
    from tokenmill.engine.core.builder import build_kv_transfer

    gemma = ModelConfig("Gemma3ForCausalLM", 262144, 640, 2048, 18, 4, 1, 256,
                        sliding_window=512)
    config = EngineConfig(cache=CacheConfig(kv_transfer=KVTransferConfig(kv_role="kv_consumer")))
    with pytest.raises(ValueError, match="sliding-window models"):
        build_kv_transfer(config, gemma, None, None, None)
