"""Issue 21 (W3): a batch-1 decode step in one native call (engine/fused_decode.py,
kernels/decode_step.c) gives the module path's tokens and logits, and is taken only
where it does."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import small_engine
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.engine import fused_decode
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.kernels import decode_step, q4q8_gemv
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not (decode_step.available() and q4q8_gemv.available()),
                                reason="decode_step not built")
PROMPTS = ["The capital of France is",  # 6 tokens: decode crosses the block at 16
           "def fibonacci(n):\n    " * 4,  # ~30 tokens: starts in the second block
           ("Once upon a time, in a land far away, there lived a king who had three "
            "daughters. The youngest")]


@pytest.fixture(scope="module")
def engines():
    return {"gguf-a16": small_engine(quantization="gguf-a16"),
            "gguf-a8": small_engine(quantization="gguf-a8")}


class _Recorder:
    """Every step's logits, and how many steps ran the fused call."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.logits: list[torch.Tensor] = []
        self.fused_steps = 0
        runner = engine.runner
        forward, step = runner.forward, decode_step.step

        def record(*args):
            out = forward(*args)
            self.logits.append(out.clone())
            return out

        def count(*args):
            self.fused_steps += 1
            return step(*args)

        monkeypatch.setattr(runner, "forward", record)
        monkeypatch.setattr(decode_step, "step", count)


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


@pytest.mark.parametrize("method", ["gguf-a16", "gguf-a8"])
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
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        rec.logits.clear()


def test_two_sequences_run_the_module_path_and_match_batch_one(engines, monkeypatch):
    engine = engines["gguf-a16"]
    alone = _greedy(engine, PROMPTS[0], 12, fused=True)
    rec = _Recorder(engine, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[1], params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = list(out.outputs[0].token_ids)
    assert rec.fused_steps == 0  # two rows per step: the modules
    assert done["a"] == alone


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


def test_off_by_env_and_for_what_it_does_not_cover(engines, monkeypatch):
    runner = engines["gguf-a16"].runner
    args = (runner.model, runner.backend, runner.kv_caches)
    assert fused_decode.unsupported_reason(*args) is None
    monkeypatch.setenv("TOKENMILL_FUSED_DECODE", "0")
    assert fused_decode.unsupported_reason(*args) == "TOKENMILL_FUSED_DECODE=0"
    monkeypatch.delenv("TOKENMILL_FUSED_DECODE")
    fp32 = small_engine(dtype="float32")  # the exact reference keeps its modules
    assert fp32.runner.fused_decode is None
    assert "gguf-a16" in fused_decode.unsupported_reason(
        fp32.runner.model, fp32.runner.backend, fp32.runner.kv_caches)


@pytest.mark.parametrize("threads", [2, 3])
def test_the_threads_split_changes_no_result(engines, threads, monkeypatch):
    engine = engines["gguf-a16"]
    rec = _Recorder(engine, monkeypatch)
    module_ids = _greedy(engine, PROMPTS[1], 10, fused=False)
    module_logits = list(rec.logits)
    rec.logits.clear()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # uneven shares of heads and row groups at 3
    try:
        fused_ids = _greedy(engine, PROMPTS[1], 10, fused=True)
    finally:
        torch.set_num_threads(before)
    assert rec.fused_steps == 9
    assert fused_ids == module_ids
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
