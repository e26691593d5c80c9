"""Scheduler: token budget, decode first, chunked prefill, preemption, abort,
and a random simulation driven to completion under a tiny KV cache."""

import random

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.kvcache.block_manager import BlockManager
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                   enable_prefix_caching=True):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, bm)


def make_seq(prompt, max_tokens=4, request_id=None):
    request_id = request_id or f"req-{random.random()}"
    return Sequence(request_id, list(prompt), SamplingParams(max_tokens=max_tokens))


def fake_token(token_ids):
    """A deterministic 'model': the next token depends on every token before it."""
    return (sum(t * (i + 1) for i, t in enumerate(token_ids)) * 31 + len(token_ids)) % 1000


def expected_output(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(fake_token(tokens))
    return tokens[len(prompt):]


def step(sched):
    """One engine step: schedule, 'run the model', sample, stop, finish_step."""
    out = sched.schedule()
    for s in out.scheduled:
        seq = s.seq
        assert len(seq.block_table) * sched.block_manager.block_size >= \
            seq.num_computed_tokens + s.num_new_tokens
        if s.sample:
            seq.append_token(fake_token(seq.token_ids))
            if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                seq.finish("length")
    sched.finish_step(out)
    return out


def test_token_budget_is_respected_and_every_prompt_is_served():
    sched = make_scheduler(max_num_batched_tokens=10)
    seqs = [make_seq(range(i * 10, i * 10 + 8)) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    out = step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [8, 2]
    while sched.has_unfinished():
        assert step(sched).num_batched_tokens <= 10
    assert all(s.output_token_ids == expected_output(s.prompt_token_ids, 4) for s in seqs)


def test_decodes_are_scheduled_before_new_prefills():
    sched = make_scheduler(max_num_batched_tokens=16)
    first = make_seq(range(5), max_tokens=10)
    sched.add(first)
    step(sched)
    long_prompt = make_seq(range(100, 140))
    sched.add(long_prompt)
    out = step(sched)
    assert [(s.seq, s.num_new_tokens, s.sample) for s in out.scheduled] == \
        [(first, 1, True), (long_prompt, 15, False)]


def test_long_prompt_is_chunked_and_samples_only_on_the_last_chunk():
    sched = make_scheduler(max_num_batched_tokens=16)
    seq = make_seq(range(50), max_tokens=2)
    sched.add(seq)
    chunks = []
    for _ in range(4):
        (s,) = step(sched).scheduled
        chunks.append((s.num_new_tokens, s.sample))
    assert chunks == [(16, False), (16, False), (16, False), (2, True)]
    assert seq.num_output_tokens == 1 and seq.first_scheduled_time is not None
    (s,) = step(sched).scheduled
    assert (s.num_new_tokens, s.sample) == (1, True)
    assert seq.is_finished and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(range(i * 10, i * 10 + 3), max_tokens=2) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    out = step(sched)
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert sched.num_running == 2 and sched.num_waiting == 1
    assert seqs[2].status is SequenceStatus.WAITING
    step(sched)  # both finish
    out = step(sched)
    assert [s.seq for s in out.scheduled] == [seqs[2]]


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_requeues_the_newest_at_the_front_and_it_completes(enable_prefix_caching):
    # 4 blocks of 2 tokens: two 4-token prompts fill the cache; the first decode
    # needs a third block for `first`, so `second` (admitted last) is preempted.
    sched = make_scheduler(num_blocks=4, block_size=2, enable_prefix_caching=enable_prefix_caching)
    first, second = make_seq([1, 2, 3, 4], 3), make_seq([5, 6, 7, 8], 3)
    third = make_seq([9], 1)
    for seq in (first, second):
        sched.add(seq)
    step(sched)
    sched.add(third)
    out = step(sched)
    assert out.preempted == [second] and sched.num_preemptions == 1
    assert [s.seq for s in out.scheduled] == [first]
    assert list(sched.waiting) == [second, third]  # front of the queue, ahead of `third`
    assert second.block_table == [] and second.num_computed_tokens == 0
    assert second.status is SequenceStatus.WAITING
    assert second.num_output_tokens == 1  # its sampled token is kept and recomputed
    while sched.has_unfinished():
        admitted = [s.seq for s in step(sched).scheduled]
        assert not (third in admitted and second.status is SequenceStatus.WAITING)  # FIFO
    for seq in (first, second, third):
        max_tokens = seq.sampling_params.max_tokens
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids, max_tokens)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and not any(bm.ref_counts)


def test_a_lone_sequence_that_outgrows_the_cache_is_reported():
    sched = make_scheduler(num_blocks=2, block_size=2)
    seq = make_seq([1, 2, 3], max_tokens=5)  # 8 tokens > 4 slots: should be rejected at add
    sched.add(seq)
    with pytest.raises(RuntimeError, match="cannot fit"):
        for _ in range(10):
            step(sched)
    assert sched.num_preemptions == 1


def test_abort_frees_waiting_and_running_sequences():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    running, waiting = make_seq(range(6), request_id="a"), make_seq(range(6), request_id="b")
    sched.add(running)
    sched.add(waiting)
    step(sched)
    assert sched.num_running == 1 and sched.num_waiting == 1
    assert sched.abort("zzz") == []
    assert sched.abort("b") == [waiting] and waiting.finish_reason == "abort"
    assert sched.abort("a") == [running] and running.finish_reason == "abort"
    assert not sched.has_unfinished()
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and not any(bm.ref_counts)


def test_abort_during_a_step_is_harmless():
    sched = make_scheduler()
    seq = make_seq(range(6), request_id="a")
    sched.add(seq)
    out = sched.schedule()
    sched.abort("a")
    sched.finish_step(out)
    assert not sched.has_unfinished() and sched.block_manager.usage == 0.0


def test_retire_frees_finished_sequences_running_or_preempted():
    """Async scheduling learns a sequence ended after the next step was scheduled:
    retire frees it wherever it is, and that step's row of it is skipped."""
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    running, waiting = make_seq(range(6), request_id="a"), make_seq(range(6), request_id="b")
    sched.add(running)
    sched.add(waiting)
    step(sched)
    out = sched.schedule()  # the step that still computes `running`
    running.finish("stop")
    waiting.finish("stop")
    sched.retire([running, waiting])
    sched.finish_step(out)
    assert not sched.has_unfinished() and running.num_computed_tokens == 6
    sched.block_manager.check_integrity([])
    assert sched.block_manager.usage == 0.0


def test_siblings_of_an_n_request_share_the_computed_prompt():
    sched = make_scheduler(block_size=4)
    prompt = list(range(10))
    first = make_seq(prompt, max_tokens=3, request_id="r")
    sched.add(first)
    step(sched)  # the prompt is computed: the engine now adds the siblings
    siblings = [make_seq(prompt, max_tokens=3, request_id="r") for _ in range(2)]
    for sib in siblings:
        sched.add(sib)
    out = step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [1, 2, 2]  # 8 of 10 prompt tokens hit
    assert all(sib.num_cached_tokens == 8 for sib in siblings)
    assert siblings[0].block_table[:2] == first.block_table[:2] == siblings[1].block_table[:2]
    assert len(sched.abort("r")) == 3
    assert sched.block_manager.usage == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_random_requests_under_a_tiny_cache_all_complete(seed):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=4,
                           max_num_batched_tokens=16, enable_prefix_caching=seed % 2 == 0)
    bm = sched.block_manager
    shared_prefix = [rng.randrange(1000) for _ in range(9)]
    pending = []
    for i in range(30):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
        if rng.random() < 0.5:
            prompt = shared_prefix + prompt
        max_tokens = rng.randint(1, 12)
        if len(prompt) + max_tokens <= bm.max_tokens_that_fit():  # the engine's add check
            pending.append(make_seq(prompt, max_tokens, request_id=f"r{i}"))
    seqs = list(pending)
    for _ in range(2000):
        while pending and rng.random() < 0.3:
            sched.add(pending.pop(0))
        if not sched.has_unfinished() and not pending:
            break
        out = step(sched)
        assert out.num_batched_tokens <= 16 and len(out.scheduled) <= 4
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        in_use = sum(len(s.block_table) for s in sched.running)
        assert sum(bm.ref_counts) == in_use  # every held block belongs to a running seq
        assert all(not s.block_table for s in sched.waiting)
    assert not sched.has_unfinished() and not pending
    assert sched.num_preemptions > 0
    for seq in seqs:
        assert seq.finish_reason == "length"
        assert seq.output_token_ids == expected_output(seq.prompt_token_ids,
                                                       seq.sampling_params.max_tokens)
    assert bm.num_free_blocks == bm.num_total_blocks and not any(bm.ref_counts)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_that_takes_it_whole():
    bm = BlockManager(64, 4, True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=20,
                                      enable_chunked_prefill=False), bm)
    a, b = make_seq(range(12)), make_seq(range(100, 112))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    # a takes 12 of 20 tokens; b's 12 do not fit in the 8 left and are not split
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 12)]
    assert b.status is SequenceStatus.WAITING
