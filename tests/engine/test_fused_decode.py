"""Issue 21 (W2, W3): a decode step in one native call (engine/fused_decode.py,
kernels/decode_step.c), for one sequence or a batch of them, gives the module path's
tokens and logits, and is taken only where it does."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import small_engine
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.engine.core.llm_engine import LLMEngine
from tokenmill.engine.runner import fused_decode
from tokenmill.kernels import bf16_gemv, decode_step, q4q8_gemv
from tokenmill.quant import widened
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not (decode_step.available() and q4q8_gemv.available()),
                                reason="decode_step not built")
PROMPTS = ["The capital of France is",  # 6 tokens: decode crosses the block at 16
           "def fibonacci(n):\n    " * 4,  # ~30 tokens: starts in the second block
           ("Once upon a time, in a land far away, there lived a king who had three "
            "daughters. The youngest")]


@pytest.fixture(scope="module")
def engines():
    return {"gguf-a16": small_engine(quantization="gguf-a16", max_num_seqs=8),
            "gguf-a8": small_engine(quantization="gguf-a8", max_num_seqs=8),
            # a bf16 model: every linear bf16_gemv.c's, inside the call
            "none": small_engine(quantization="none", dtype="bfloat16", max_num_seqs=10),
            # an 8-bit KV cache (--kv-cache-dtype): stored and read inside the call
            "int8-kv": small_engine(quantization="gguf-a16", max_num_seqs=8,
                                    kv_cache_dtype="int8"),
            "fp8-kv": small_engine(quantization="gguf-a16", max_num_seqs=8,
                                   kv_cache_dtype="fp8")}


def _same_logits(method: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if method == "none":  # the same bf16 GEMV rows as the modules': bit for bit
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _Recorder:
    """Every step's logits, and how many steps ran the fused call."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.logits: list[torch.Tensor] = []
        self.fused_steps = 0  # batch-1 calls
        self.batch_rows: list[int] = []  # rows of each batched call
        self.batch_shared: list[int] = []  # and the shared prefix blocks it was given
        runner = engine.runner
        forward, step, step_batch = runner.forward, decode_step.step, decode_step.step_batch

        def record(*args):
            out = forward(*args)
            self.logits.append(out.clone())
            return out

        def count(*args):
            self.fused_steps += 1
            return step(*args)

        def count_batch(model, tokens, *args):
            self.batch_rows.append(tokens.shape[0])
            self.batch_shared.append(args[-1] if len(args) == 7 else 0)
            return step_batch(model, tokens, *args)

        monkeypatch.setattr(runner, "forward", record)
        monkeypatch.setattr(decode_step, "step", count)
        monkeypatch.setattr(decode_step, "step_batch", count_batch)


def _greedy(engine: LLMEngine, prompt: str, n: int, fused: bool) -> list[int]:
    engine.runner.fused_decode.enabled = fused
    try:
        engine.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=n,
                                                       ignore_eos=True))
        ids: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                ids = list(out.outputs[0].token_ids)
        return ids
    finally:
        engine.runner.fused_decode.enabled = True


@pytest.mark.parametrize("method", ["gguf-a16", "gguf-a8", "none", "int8-kv", "fp8-kv"])
def test_fused_decode_gives_the_module_paths_tokens_and_logits(engines, method, monkeypatch):
    engine = engines[method]
    assert engine.runner.fused_decode is not None, fused_decode.unsupported_reason(
        engine.runner.model, engine.runner.backend, engine.runner.kv_caches)
    rec = _Recorder(engine, monkeypatch)
    for prompt in PROMPTS:
        rec.logits.clear()
        fused_ids = _greedy(engine, prompt, 40, fused=True)
        fused_logits = list(rec.logits)
        assert rec.fused_steps == 39  # every step after the prompt's
        rec.fused_steps = 0
        module_ids = _greedy(engine, prompt, 40, fused=False)
        assert rec.fused_steps == 0
        assert fused_ids == module_ids
        assert len(fused_logits) == len(rec.logits[len(fused_logits):]) == 40
        for a, b in zip(fused_logits, rec.logits[len(fused_logits):], strict=True):
            _same_logits(method, a, b)
        rec.logits.clear()


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    """Steps until every request is done: each request's token ids."""
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = list(out.outputs[0].token_ids)
    return done


def _greedy_batch(engine: LLMEngine, prompts: list[str], n: int, fused: bool
                  ) -> dict[str, list[int]]:
    engine.runner.fused_decode.enabled = fused
    try:
        for i, prompt in enumerate(prompts):  # ragged: 2 to 24 new tokens each
            engine.add_request(str(i), prompt, SamplingParams(
                temperature=0, max_tokens=max(2, n - 5 * i), ignore_eos=True))
        return _drain(engine)
    finally:
        engine.runner.fused_decode.enabled = True


# five sequences of different lengths (one crosses a block while the others decode)
BATCH = PROMPTS + ["Write a haiku about the sea.", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]


@pytest.mark.parametrize("method", ["gguf-a16", "gguf-a8", "none", "int8-kv", "fp8-kv"])
def test_a_batch_of_sequences_gives_the_module_paths_tokens_and_logits(engines, method,
                                                                     monkeypatch):
    engine = engines[method]
    rec = _Recorder(engine, monkeypatch)
    fused_ids = _greedy_batch(engine, BATCH, 24, fused=True)
    fused_logits, fused_rows = list(rec.logits), list(rec.batch_rows)
    rec.logits.clear()
    rec.batch_rows.clear()
    rec.fused_steps = 0
    module_ids = _greedy_batch(engine, BATCH, 24, fused=False)
    assert rec.batch_rows == [] and rec.fused_steps == 0
    # every step with no prompt in it took the batched call: 5 rows, then fewer as
    # the ragged requests finish
    assert 5 in fused_rows and 2 in fused_rows and max(fused_rows) == 5
    assert fused_ids == module_ids
    assert len(fused_logits) == len(rec.logits)
    for a, b in zip(fused_logits, rec.logits, strict=True):
        _same_logits(method, a, b)


def test_a_bf16_model_runs_fused_up_to_the_gemvs_rows_and_the_modules_past_them(
        engines, monkeypatch):
    """A bf16 model's steps are fused up to bf16_gemv.c's rows (passes of 8 past 8
    rows), with the modules' bits; past them its linears are F.linear's (oneDNN), and
    the step the module path's. 10 ragged requests decode 10 rows a step, then fewer
    (fused from the GEMV's 48 rows with vdpbf16ps; without it, AVX2, from 8)."""
    engine = engines["none"]
    fused = engine.runner.fused_decode
    assert fused.plain and fused.max_rows == bf16_gemv.max_rows() >= 8
    n = fused.max_rows
    assert fused.takes([1] * n, list(range(n)))
    assert not fused.takes([1] * (n + 1), list(range(n + 1)))
    rec = _Recorder(engine, monkeypatch)
    prompts = BATCH * 2
    params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True)
              for i in range(len(prompts))]

    def run(on: bool) -> dict[str, list[int]]:
        fused.enabled = on
        try:
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), prompt, params[i])
            return _drain(engine)
        finally:
            fused.enabled = True

    got, got_logits = run(True), list(rec.logits)
    assert max(rec.batch_rows) == min(10, n) and min(rec.batch_rows) == 2
    rec.logits.clear()
    assert got == run(False)
    assert [len(got[str(i)]) for i in range(10)] == [3 + i for i in range(10)]
    assert len(got_logits) == len(rec.logits)
    for a, b in zip(got_logits, rec.logits, strict=True):
        assert torch.equal(a, b)
    rec.batch_rows.clear()
    monkeypatch.setattr(fused, "max_rows", 8)  # 9 and 10 rows: the modules
    assert run(True) == got and max(rec.batch_rows) == 8


def test_more_rows_than_the_kernel_serves_run_the_module_path(engines, monkeypatch):
    engine = engines["gguf-a16"]
    fused = engine.runner.fused_decode
    # W2 and most of W1 run fused; all of it where the modules' batched linears are the
    # same kernel (gemm16)
    wide = fused.record.wide_min_rows > 0
    assert fused.max_rows == (fused_decode.WIDE_MAX_ROWS if wide else fused_decode.MAX_ROWS)
    assert fused.max_rows >= 64
    assert fused.takes([1] * 256, list(range(256))) == wide
    monkeypatch.setattr(fused, "max_rows", 64)
    assert fused.takes([1] * 64, list(range(64)))
    assert not fused.takes([1] * 65, list(range(65)))
    assert not fused.takes([1, 3], [0, 1])  # a prompt chunk or a verification
    assert not fused.takes([1, 1], [1])  # a row not sampled
    monkeypatch.setattr(fused, "max_rows", 2)
    rec = _Recorder(engine, monkeypatch)
    fused_ids = _greedy_batch(engine, BATCH[:3], 12, fused=True)
    assert rec.batch_rows and max(rec.batch_rows) == 2  # three rows: the modules
    assert fused_ids == _greedy_batch(engine, BATCH[:3], 12, fused=False)


def test_an_out_of_range_input_is_refused_with_nothing_written(engines):
    runner = engines["gguf-a16"].runner
    fused = runner.fused_decode
    k0 = runner.kv_caches[0][0].clone()
    num_slots = runner.num_blocks * runner.block_size
    for token, slot, table in [(5, num_slots, 1), (-1, 3, 1), (10**6, 3, 1),
                               (5, 3, runner.num_blocks)]:
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([slot]), query_start_loc=torch.tensor([0, 1]),
            seq_lens=torch.tensor([4], dtype=torch.int32),
            block_tables=torch.tensor([[table]], dtype=torch.int32), block_size=16,
            max_query_len=1, max_seq_len=4, query_lens_list=[1], seq_lens_list=[4])
        assert fused.run(torch.tensor([token]), torch.tensor([3]), meta) is None
    # bytes, not values: never-used blocks hold whatever memory held (NaN != NaN)
    assert torch.equal(runner.kv_caches[0][0].view(torch.int16), k0.view(torch.int16))
    # a batch with one bad row writes nothing for any row
    for token, slot, table in [(5, num_slots, 1), (10**6, 3, 1), (5, 3, runner.num_blocks)]:
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([2, slot]), query_start_loc=torch.tensor([0, 1, 2]),
            seq_lens=torch.tensor([3, 4], dtype=torch.int32),
            block_tables=torch.tensor([[1], [table]], dtype=torch.int32), block_size=16,
            max_query_len=1, max_seq_len=4, query_lens_list=[1, 1], seq_lens_list=[3, 4])
        assert fused.run(torch.tensor([7, token]), torch.tensor([2, 3]), meta) is None
    assert torch.equal(runner.kv_caches[0][0].view(torch.int16), k0.view(torch.int16))


def test_off_by_env_and_for_what_it_does_not_cover(engines, monkeypatch):
    runner = engines["gguf-a16"].runner
    args = (runner.model, runner.backend, runner.kv_caches)
    assert fused_decode.unsupported_reason(*args) is None
    monkeypatch.setenv("TOKENMILL_FUSED_DECODE", "0")
    assert fused_decode.unsupported_reason(*args) == "TOKENMILL_FUSED_DECODE=0"
    monkeypatch.delenv("TOKENMILL_FUSED_DECODE")
    fp32 = small_engine(dtype="float32")  # the exact reference keeps its modules
    assert fp32.runner.fused_decode is None
    assert "nor bf16" in fused_decode.unsupported_reason(
        fp32.runner.model, fp32.runner.backend, fp32.runner.kv_caches)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("method", ["gguf-a16", "int8-kv"])
def test_the_threads_split_changes_no_result(engines, threads, method, monkeypatch):
    engine = engines[method]
    rec = _Recorder(engine, monkeypatch)
    module_ids = _greedy(engine, PROMPTS[1], 10, fused=False)
    module_batch = _greedy_batch(engine, BATCH[:4], 10, fused=False)
    module_logits = list(rec.logits)
    rec.logits.clear()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # uneven shares of heads, rows and row groups at 3
    try:
        fused_ids = _greedy(engine, PROMPTS[1], 10, fused=True)
        fused_batch = _greedy_batch(engine, BATCH[:4], 10, fused=True)
    finally:
        torch.set_num_threads(before)
    assert rec.fused_steps >= 9 and 4 in rec.batch_rows  # batch 1 and the batch of 4
    assert fused_ids == module_ids and fused_batch == module_batch
    for a, b in zip(rec.logits, module_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_async_scheduling_takes_it_with_the_same_tokens(monkeypatch):
    # the next step's input id is the previous step's sample, patched in on the device
    engine = small_engine(quantization="gguf-a16", async_scheduling=True)
    rec = _Recorder(engine, monkeypatch)
    fused_ids = _greedy(engine, PROMPTS[0], 20, fused=True)
    assert rec.fused_steps == 19
    assert engine.stats.num_async_steps > 0
    assert fused_ids == _greedy(engine, PROMPTS[0], 20, fused=False)


def test_past_the_dense_switch_each_row_decodes_as_it_does_alone(monkeypatch):
    # 24 rows: the module path would run its linears on dense bf16 weights (from
    # VNNI_DENSE_MIN_ROWS = 20); the fused step keeps every row on the kernel, as alone
    engine = small_engine(quantization="gguf-a16", max_num_seqs=24)
    rec = _Recorder(engine, monkeypatch)
    # prompts of 20+ tokens: alone or together, each prompt runs on the dense weights
    prompts = [f"Note {i}: on a clear summer day, seen from the top of a hill far from "
               "any town, the colour of the sky is" for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = _drain(engine)
    assert max(rec.batch_rows) > 20  # (the 16 MiB cache holds 22 of them at once)
    for i in (0, 13, 23):
        assert done[str(i)] == _greedy(engine, prompts[i], 6, fused=True)


@pytest.mark.skipif(not widened.available(), reason="gemm16 widens the records on AVX2")
@pytest.mark.parametrize("threads", [None, 3])
def test_a_wide_batch_run_as_gemm16_gives_the_per_row_passes_bits(monkeypatch, threads):
    """With `--batched-linears int16` a fused step of WIDE_MIN_ROWS+ rows runs every
    linear and the LM head as gemm16 does: the tokens and logits of the same step on
    the kernel's per-row passes, bit for bit. With 2 threads the 22 rows' linears split
    into (group block, tile) items; with 3, into groups; either way the threads take
    them as they come free."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        _wide_against_per_row(monkeypatch)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not widened.available(), reason="gemm16 widens the records on AVX2")
def test_a_step_past_the_old_row_limit_runs_fused_with_the_module_paths_tokens(monkeypatch):
    """Where the modules' batched linears are gemm16, a decode step of more rows than
    MAX_ROWS (W1's steps run up to ~200) is one fused call, with the modules' tokens."""
    rows = fused_decode.MAX_ROWS + 9
    engine = small_engine(kv_cache_mib=128, quantization="gguf-a16", max_num_seqs=rows,
                          max_num_batched_tokens=2048)
    assert engine.runner.fused_decode.max_rows == fused_decode.WIDE_MAX_ROWS
    rec = _Recorder(engine, monkeypatch)
    prompts = [f"Item {i} of the list is" for i in range(rows)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def run(fused: bool) -> dict[str, list[int]]:
        engine.runner.fused_decode.enabled = fused
        try:
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), prompt, params)
            return _drain(engine)
        finally:
            engine.runner.fused_decode.enabled = True

    fused = run(True)
    assert max(rec.batch_rows) == rows
    rec.batch_rows.clear()
    assert fused == run(False) and rec.batch_rows == []
    assert len(fused) == rows and all(len(ids) == 3 for ids in fused.values())


def _wide_against_per_row(monkeypatch) -> None:
    engine = small_engine(quantization="gguf-a16", max_num_seqs=24, batched_linears="int16")
    fd = engine.runner.fused_decode
    assert fd.record.wide_min_rows == fused_decode.WIDE_MIN_ROWS < 22
    rec = _Recorder(engine, monkeypatch)
    prompts = [f"Note {i}: the colour of the sky on a clear summer day is" for i in range(22)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(min_rows: int) -> tuple[dict[str, list[int]], list[torch.Tensor], list[int]]:
        fd.record.wide_min_rows = min_rows
        rec.logits.clear()
        rec.batch_rows.clear()
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        return _drain(engine), list(rec.logits), list(rec.batch_rows)

    try:
        wide, per_row = run(fused_decode.WIDE_MIN_ROWS), run(0)
    finally:
        fd.record.wide_min_rows = fused_decode.WIDE_MIN_ROWS
    assert wide[2] == per_row[2] and max(wide[2]) == 22  # batched calls, 22 rows each
    assert wide[0] == per_row[0]
    assert len(wide[1]) == len(per_row[1]) == 6
    for a, b in zip(wide[1], per_row[1], strict=True):
        assert torch.equal(a, b)


def test_rows_sharing_a_prefix_read_it_once_with_the_modules_cascade_bits(engines,
                                                                          monkeypatch):
    # 8 rows over the same 8 leading blocks of random K/V: the step attends to them once
    # for all rows (the cascade, inside the call) with the module path's cascade call's
    # arithmetic; rows with no common block take the per-row attention
    runner = engines["gguf-a16"].runner
    n, lens = 8, [8 * 16 + 5 + i for i in range(8)]
    tables = torch.tensor([list(range(1, 9)) + [9 + i] for i in range(n)], dtype=torch.int32)
    slots = torch.tensor([(9 + i) * 16 + lens[i] - 8 * 16 - 1 for i in range(n)])

    def meta_for(t: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slots, query_start_loc=torch.arange(n + 1),
            seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=t, block_size=16,
            max_query_len=1, max_seq_len=max(lens), query_lens_list=[1] * n,
            seq_lens_list=lens)
    saved = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:
        for pool in (k, v):
            pool[:, 1:29] = (torch.randn(pool[:, 1:29].shape, generator=gen) * 0.05).to(pool.dtype)
    rec = _Recorder(engines["gguf-a16"], monkeypatch)
    ids, pos, rows = torch.arange(n) + 100, torch.tensor(lens) - 1, list(range(n))
    own = tables.clone()
    own[:, 0] = torch.arange(20, 20 + n, dtype=torch.int32)  # no common first block
    try:
        with torch.inference_mode():
            fused = [runner.forward(ids, pos, meta_for(t), rows).clone() for t in (tables, own)]
            runner.fused_decode.enabled = False
            modules = [runner.forward(ids, pos, meta_for(t), rows) for t in (tables, own)]
    finally:
        runner.fused_decode.enabled = True
        for (k, v), (k0, v0) in zip(runner.kv_caches, saved, strict=True):
            k.copy_(k0)
            v.copy_(v0)
    assert rec.batch_shared == [8, 0]
    for a, b in zip(fused, modules, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_cached_prefix_gives_the_module_paths_cascade_tokens_and_logits(monkeypatch):
    # 8 requests after a 9-block prompt is cached: their decode steps share its blocks
    # and take the fused call with the cascade inside, with the modules' bits
    from tokenmill.config import CacheConfig, EngineConfig

    engine = LLMEngine(EngineConfig(quantization="gguf-a16", max_num_seqs=8, cache=CacheConfig(
        enable_prefix_caching=True, kv_cache_memory_bytes=16 * 2**20)))
    system = ("You are a careful assistant. Answer in one short sentence, plainly, "
              "without lists. ") * 9
    assert len(engine.tokenizer.encode(system)) >= 9 * 16
    rec = _Recorder(engine, monkeypatch)
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]

    def run(fused: bool) -> dict[str, list[int]]:
        engine.runner.fused_decode.enabled = fused
        try:
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            engine.add_request("warm", system, SamplingParams(max_tokens=1))
            _drain(engine)
            rec.logits.clear()
            for i, q in enumerate(questions):
                engine.add_request(str(i), system + q, params)
            return _drain(engine)
        finally:
            engine.runner.fused_decode.enabled = True
    fused_ids = run(True)
    fused_logits = list(rec.logits)
    assert rec.batch_shared and min(rec.batch_shared) >= 8  # every batched step: shared
    rec.batch_shared.clear()
    module_ids = run(False)
    assert rec.batch_shared == []
    assert fused_ids == module_ids
    assert len(fused_logits) == len(rec.logits)
    for a, b in zip(fused_logits, rec.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
