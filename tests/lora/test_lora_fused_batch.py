"""LoRA adapters inside the batched fused decode step (kernels/lora_delta.h): a step of
base rows and rows of 3 adapters (different ranks, some projections without an
adapter) gives the module path's logits (models/lora.py's grouped products), step by
step across block boundaries, on a tiny quantized GGUF Llama and a bf16 one, with 1-3
threads, and with decode_step.c built for AVX2."""

from __future__ import annotations

import pytest
import torch

from tests.model.conftest import make_hf_model, write_tiny_gguf
from tokenmill.engine.runner import weights
from tokenmill.engine.runner.model_runner import ModelRunner, StepInputs
from tokenmill.kernels import decode_step, q4q8_gemv
from tokenmill.loaders import resolve_model
from tokenmill.models.lora import apply_lora

pytestmark = pytest.mark.skipif(not (decode_step.available() and q4q8_gemv.available()),
                                reason="decode_step not built")
BLOCK = 16
# adapter id -> (rank, the sub-projections it targets)
ADAPTERS = {1: (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                    "down_proj")),
            2: (5, ("q_proj", "v_proj", "down_proj")),  # odd: padded to 6 for the kernel
            3: (16, ("k_proj", "o_proj", "gate_proj", "up_proj"))}
# the rows' adapters: the base twice, adapter 1 twice (one group of two rows)
ROW_LORAS = [0, 1, 2, 0, 3, 1]
# The kernel sums A x and B (A x) in its own (vector) order, torch in oneDNN's: the same
# values to one bf16 rounding of a delta, which can move a later bf16 activation by one
# rounding step. Seen on these tiny models (K <= 128): 0.0, the same bits.
ATOL = 0.1


def _runner(tmp_path, quantization: str) -> ModelRunner:
    path = write_tiny_gguf(make_hf_model("llama"), tmp_path / "tiny.gguf")
    loaded, _ = weights.load_engine_model(resolve_model(str(path)), "bfloat16", quantization,
                                          torch.device("cpu"))
    runner = ModelRunner(loaded.model, loaded.config, BLOCK, 64, torch.bfloat16,
                         torch.device("cpu"), "cpu")
    assert runner.fused_decode is not None
    gen = torch.Generator().manual_seed(0)
    for _, _, mod in apply_lora(runner.model):
        for lora_id, (rank, targets) in ADAPTERS.items():
            pairs = {}
            for name, size in zip(mod.names, mod.sizes):
                if name in targets:
                    fan_in = int(mod.base.in_features)
                    a = torch.randn(rank, fan_in, generator=gen) * fan_in ** -0.5
                    b = torch.randn(size, rank, generator=gen) * 0.3
                    pairs[name] = (a.bfloat16(), b.bfloat16())
            mod.install(lora_id, pairs)
    return runner


def _step(runner: ModelRunner, tokens: list[list[int]], starts: list[int],
          tables: list[list[int]], fresh: list[int], row_loras: list[int] = ROW_LORAS
          ) -> torch.Tensor:
    """One step of len(tokens) sequences (sequence i: tokens[i] from position
    starts[i]) under row_loras: the logits of each sequence's last row."""
    ids, positions, slots, qstart, lens, qlens, rows = [], [], [], [0], [], [], []
    for toks, start, table in zip(tokens, starts, tables):
        pos = list(range(start, start + len(toks)))
        ids += toks
        positions += pos
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in pos]
        qstart.append(qstart[-1] + len(toks))
        lens.append(start + len(toks))
        qlens.append(len(toks))
        rows.append(qstart[-1] - 1)
    inputs = StepInputs(ids, positions, slots, qstart, lens, qlens, tables, fresh, rows,
                        lora_ids=row_loras[:len(tokens)])
    ids_t, pos, meta, logit_rows = runner.upload(runner.stage_inputs(inputs))
    return runner.forward(ids_t, pos, meta, logit_rows)


def _decode_both_ways(runner: ModelRunner, row_loras: list[int] = ROW_LORAS) -> int:
    """Prefill row_loras' sequences (the module path), then decode them across two block
    boundaries, each step on the module path and then fused (over the same K/V slots):
    the same logits to ATOL, the same greedy tokens. Returns the fused steps taken."""
    fused = runner.fused_decode
    n = len(row_loras)
    tables = [[3 * i + 2, 3 * i, 3 * i + 1] for i in range(n)]  # out of order
    prompts = [[5 + i, 17, 200, 33 + i, 9, 101, 64 + 2 * i][:4 + i % 4] for i in range(n)]
    logits = _step(runner, prompts, [0] * n, tables, [b for t in tables for b in t],
                   row_loras)
    tokens = [int(t) for t in logits.argmax(-1)]
    pos = [len(p) for p in prompts]
    steps = 0
    while max(pos) < 2 * BLOCK + 3:
        fused.enabled = False
        expected = _step(runner, [[t] for t in tokens], pos, tables, [], row_loras)
        fused.enabled = True
        got = _step(runner, [[t] for t in tokens], pos, tables, [], row_loras)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
        tokens, pos, steps = got.argmax(-1).tolist(), [p + 1 for p in pos], steps + 1
    return steps


def _count_fused(monkeypatch) -> list[int]:
    """The number of adapter slots of every fused batched call."""
    slots = []
    step_batch = decode_step.step_batch

    def counted(*a, **kw):
        loras = kw.get("loras", a[9] if len(a) > 9 else None)
        slots.append(len(loras or []))
        return step_batch(*a, **kw)
    monkeypatch.setattr(decode_step, "step_batch", counted)
    return slots


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("quantization", ["gguf-a16", "none"])
def test_a_mixed_batch_of_adapters_and_the_base_in_the_fused_step(tmp_path, quantization,
                                                                  threads, monkeypatch):
    runner = _runner(tmp_path, quantization)
    slots = _count_fused(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        steps = _decode_both_ways(runner)
    finally:
        torch.set_num_threads(before)
    assert slots == [3] * steps  # every decode step fused, with its 3 adapters


@pytest.mark.parametrize("lora_id", [1, 3])
def test_batch_one_with_an_adapter_in_the_fused_step(tmp_path, lora_id, monkeypatch):
    """One row (tm_decode_step, each thread adding its share of the delta) under an
    adapter on every projection (1) or on some (3), 2 threads."""
    runner = _runner(tmp_path, "gguf-a16")
    calls = []
    step = decode_step.step
    monkeypatch.setattr(decode_step, "step", lambda *a: calls.append(a[8]) or step(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        steps = _decode_both_ways(runner, [lora_id])
    finally:
        torch.set_num_threads(before)
    assert len(calls) == steps and all(lora is not None for lora in calls)


def test_the_adapters_change_the_rows_they_run_under(tmp_path):
    """A kernel that dropped the deltas (or added them to the wrong rows) fails: the
    base's rows equal a base-only step's, the adapters' rows differ from it."""
    runner = _runner(tmp_path, "gguf-a16")
    n = len(ROW_LORAS)
    tables = [[i] for i in range(n)]
    prompt = [[5, 17, 200, 33]] * n  # the same prompt on every row
    _step(runner, prompt, [0] * n, tables, list(range(n)))
    with_loras = _step(runner, [[9]] * n, [4] * n, tables, [])
    base_rows = [i for i, lora in enumerate(ROW_LORAS) if not lora]
    for i, lora in enumerate(ROW_LORAS):
        same = torch.equal(with_loras[i], with_loras[base_rows[0]])
        assert same == (lora == 0), (i, lora)
    # the two rows of adapter 1 agree with each other
    ones = [i for i, lora in enumerate(ROW_LORAS) if lora == 1]
    assert torch.equal(with_loras[ones[0]], with_loras[ones[1]])


def test_the_avx2_build_applies_the_adapters(tmp_path, monkeypatch):
    """decode_step.c built for x86-64-v3 (AVX2, strict fp32: lora_delta.h's bf16 pairs
    widened where AVX512-BF16 has vdpbf16ps) gives the module path's logits on a mixed
    batch."""
    from tests.model.conftest import load_for_march

    lib = load_for_march(decode_step._lib)
    assert lib.tm_decode_step_abi() == decode_step._lib.get("tm_decode_step_abi")()
    get = decode_step._lib.get
    monkeypatch.setattr(decode_step._lib, "get",
                        lambda name: getattr(lib, name) if name.startswith("tm_") else get(name))
    runner = _runner(tmp_path, "gguf-a16")
    slots = _count_fused(monkeypatch)
    steps = _decode_both_ways(runner)
    assert slots == [3] * steps


def test_batch_one_shares_the_shrink_across_threads_and_builds(tmp_path, monkeypatch):
    """At batch 1 the threads split a row's shrink (lora_shrink_team: chunks of 8 rank
    rows, each claimed by the next free thread; adapter 1's stacked qkv rank is 24, 3
    chunks): the step's logits are the same bits at 1, 2 and 3 threads (a chunk made
    twice, skipped or read before it was written would differ, or miss the module path),
    and the AVX2 build's batch-1 step gives the module path's logits too."""
    from tests.model.conftest import load_for_march

    runner = _runner(tmp_path, "gguf-a16")
    calls = []
    step = decode_step.step
    monkeypatch.setattr(decode_step, "step", lambda *a: calls.append(a[8]) or step(*a))
    tables = [[1, 0]]
    _step(runner, [[5, 17, 200, 33, 9]], [0], tables, [1, 0], [1])
    before = torch.get_num_threads()
    try:
        got = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got.append(_step(runner, [[64]], [5], tables, [], [1]))
        assert len(calls) == 3 and all(lora is not None for lora in calls)
        assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
        runner.fused_decode.enabled = False
        torch.testing.assert_close(got[0], _step(runner, [[64]], [5], tables, [], [1]),
                                   atol=ATOL, rtol=0)
        runner.fused_decode.enabled = True

        lib = load_for_march(decode_step._lib)
        get = decode_step._lib.get
        monkeypatch.setattr(decode_step._lib, "get",
                            lambda name: getattr(lib, name) if name.startswith("tm_")
                            else get(name))
        torch.set_num_threads(2)
        calls.clear()
        steps = _decode_both_ways(runner, [1])
        assert len(calls) == steps and all(lora is not None for lora in calls)
    finally:
        torch.set_num_threads(before)
