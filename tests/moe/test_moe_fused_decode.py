"""Issue 59: MoE layers inside the fused native decode step (kernels/moe_step.h): router,
top k and the routed experts on their own records in the one call a step, batch 1 and
batched rows grouped by expert. The module path (SparseMoeBlock over RecordExperts) is
the reference: the same greedy tokens, the same logits to fp32 rounding, each sparse
layer's output alone within the softmax's rounding; experts nobody routed to are never
read; the AVX2 build too. The real synthetic benchmark file runs on request
(TOKENMILL_TEST_PEER_FILES=1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import small_engine
from tokenmill.engine.runner import fused_decode
from tokenmill.kernels import decode_step, q4q8_gemv
from tokenmill.models.moe import SparseMoeBlock, expert_bytes_read
from tokenmill.models.moe_compute import route
from tokenmill.quant.moe_experts import RecordExperts
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not (decode_step.available() and q4q8_gemv.isa() in ("avx512-vnni", "avx2")),
    reason="the fused step on the records' kernel (gguf-a16)")
# 8 experts top 2 with a dense layer 0 (Q8_0); Mixtral's Q4_K gate, Q5_K up (one mixed
# record set), Q6_K down; the synthetic file's shape: 128 experts top 8, Q8_0 / Q5_0 downs
FILES = ["qwen3moe_q8", "mixtral_kquant", "qwen3moe_synthetic_shaped"]
PROMPT = [5, 17, 99, 3, 200, 41]
BATCH = [PROMPT, [7] * 9, list(range(1, 19)), [250, 3], [100 + i for i in range(30)]]


@pytest.fixture(scope="module")
def engines(request):
    """which file -> an engine on it (gguf-a16, 8 sequences), made once."""
    made = {}

    def get(which):
        if which not in made:
            path, _ = request.getfixturevalue(which)
            made[which] = small_engine(model=str(path), quantization="gguf-a16",
                                       max_num_seqs=8)
        return made[which]
    return get


class _Steps:
    """Every step's logits, and the rows of each fused call."""

    def __init__(self, engine, monkeypatch) -> None:
        self.logits: list[torch.Tensor] = []
        self.rows: list[int] = []
        runner, forward = engine.runner, engine.runner.forward
        step, step_batch = decode_step.step, decode_step.step_batch

        def record(*args):
            out = forward(*args)
            self.logits.append(out.clone())
            return out

        def one(*args):
            self.rows.append(1)
            return step(*args)

        def many(model, tokens, *args):
            self.rows.append(tokens.shape[0])
            return step_batch(model, tokens, *args)

        monkeypatch.setattr(runner, "forward", record)
        monkeypatch.setattr(decode_step, "step", one)
        monkeypatch.setattr(decode_step, "step_batch", many)


def _generate(engine, prompts, n, fused):
    """Greedy token ids of each prompt (ragged: n, n - 4, ... new tokens)."""
    engine.runner.fused_decode.enabled = fused
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(
                temperature=0, max_tokens=max(2, n - 4 * i), ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = list(out.outputs[0].token_ids)
        return done
    finally:
        engine.runner.fused_decode.enabled = True


@pytest.mark.parametrize("which", FILES)
def test_fused_steps_give_the_module_paths_tokens_and_logits(which, engines, monkeypatch):
    engine = engines(which)
    runner = engine.runner
    assert runner.fused_decode is not None, fused_decode.unsupported_reason(
        runner.model, runner.backend, runner.kv_caches)
    steps = _Steps(engine, monkeypatch)
    for prompts, n in (([PROMPT], 16), (BATCH[:4], 12)):
        steps.logits.clear()
        steps.rows.clear()
        fused = _generate(engine, prompts, n, fused=True)
        fused_logits, fused_rows = list(steps.logits), list(steps.rows)
        steps.logits.clear()
        module = _generate(engine, prompts, n, fused=False)
        assert fused == module
        assert len(set(fused["0"])) > 3  # a real continuation
        if len(prompts) == 1:
            assert fused_rows == [1] * (n - 1)  # every step after the prompt's
        else:
            assert max(fused_rows) == len(prompts) and 2 in fused_rows
        assert len(fused_logits) == len(steps.logits)
        for a, b in zip(fused_logits, steps.logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_gguf_a8s_two_widths_run_an_moe_file_in_the_fused_step(request, monkeypatch):
    """gguf-a8 on an MoE file: the attention's linears on int16 activations, the experts
    and layer 0's dense MLP on int8 (the record's attn_bits 16, bits 8), one fused call
    a step with the module path's tokens and logits."""
    path, _ = request.getfixturevalue("qwen3moe_q8")
    engine = small_engine(model=str(path), quantization="gguf-a8", max_num_seqs=8)
    record = engine.runner.fused_decode.record
    assert (record.bits, record.attn_bits) == (8, 16)
    steps = _Steps(engine, monkeypatch)
    fused = _generate(engine, BATCH[:4], 12, fused=True)
    fused_logits = list(steps.logits)
    assert max(steps.rows) == 4
    steps.logits.clear()
    assert fused == _generate(engine, BATCH[:4], 12, fused=False)
    assert len(fused_logits) == len(steps.logits)
    for a, b in zip(fused_logits, steps.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _sparse_layers(engine):
    return [(i, layer.mlp) for i, layer in enumerate(engine.runner.model.model.layers)
            if type(layer.mlp) is SparseMoeBlock]


@pytest.mark.parametrize("which", FILES)
def test_each_sparse_layer_alone_matches_the_module_paths_block(which, engines):
    """Each sparse layer's MLP in the kernel (tm_moe_layer, as a step runs it) against
    the module path's SparseMoeBlock on the same rows: 1 row (batch-1 decode), 3, and 24
    (experts shared by many rows: gemm16 in the modules on AVX2, the same bits)."""
    engine = engines(which)
    record = engine.runner.fused_decode.record
    layers = _sparse_layers(engine)
    assert layers
    for i, block in layers:
        for rows in (1, 3, 24):
            gen = torch.Generator().manual_seed(rows + 7 * i)
            x = torch.randn(rows, block.gate.in_features, generator=gen).bfloat16()
            got = decode_step.moe_layer(record, i, x)
            with torch.no_grad():
                want = block(x)
            assert got is not None and got.isfinite().all()
            # the softmax's exp and sums are not torch's bit for bit: a routing weight
            # may round to another bf16 now and then; the rest is the modules' arithmetic
            assert (got != want).float().mean() < 0.05, (which, i, rows)
            assert (got.float() - want.float()).norm() <= 2e-3 * want.float().norm()


def test_unrouted_experts_are_never_read(engines):
    """NaN in every record of the experts the rows did not route to: the layer's output
    is the clean one, bit for bit, at one row and at many (an expert's rows grouped);
    a generation's expert bytes read are k experts a token a sparse layer."""
    engine = engines("qwen3moe_synthetic_shaped")
    record = engine.runner.fused_decode.record
    i, block = _sparse_layers(engine)[0]
    rec: RecordExperts = block.experts
    for rows in (1, 13):
        x = torch.randn(rows, rec.hidden, generator=torch.Generator().manual_seed(rows))
        x = x.bfloat16()
        with torch.no_grad():
            _, ids = route(block.gate(x), block.top_k, block.norm_topk_prob)
        clean = decode_step.moe_layer(record, i, x)
        unrouted = sorted(set(range(rec.num_experts)) - set(ids.flatten().tolist()))
        assert len(unrouted) >= 32
        saved = {e: (rec.gate_up_records[e].clone(), rec.down_records[e].clone())
                 for e in unrouted}
        try:
            for e in unrouted:
                rec.gate_up_records[e].fill_(0xFF)  # every fp16 scale NaN
                rec.down_records[e].fill_(0xFF)
            poisoned = decode_step.moe_layer(record, i, x)
        finally:
            for e, (gu, dn) in saved.items():
                rec.gate_up_records[e].copy_(gu)
                rec.down_records[e].copy_(dn)
        assert torch.equal(poisoned, clean) and clean.isfinite().all()
    # the fused steps count their reads as the modules do (explain's measured bytes)
    model = engine.runner.model
    before = expert_bytes_read(model)
    _generate(engine, [PROMPT], 9, fused=True)
    # k experts of each sparse layer (each layer's experts one size: Q8_0 or Q5_0 downs)
    unit = 0
    for _, m in _sparse_layers(engine):
        assert len(set(m.experts.expert_bytes)) == 1
        unit += m.top_k * m.experts.expert_bytes[0]
    read = expert_bytes_read(model) - before
    # the prompt (6 tokens: k experts at least, 6 k at most) and 8 decode steps of k each
    assert 9 * unit <= read <= 14 * unit


def test_the_avx2_build_runs_the_sparse_layers(engines, monkeypatch):
    """decode_step.c built for x86-64-v3 (AVX2): each sparse layer within the
    activations' rounding of the VNNI build's, and the module path's greedy tokens."""
    from tests.model.conftest import load_for_march

    engine = engines("mixtral_kquant")
    record = engine.runner.fused_decode.record
    lib = load_for_march(decode_step._lib)
    assert lib.tm_decode_step_abi() == decode_step._lib.get("tm_decode_step_abi")()
    get = decode_step._lib.get
    expected = _generate(engine, BATCH[:3], 12, fused=False)
    wants = {}
    for i, block in _sparse_layers(engine):
        for rows in (1, 24):
            x = torch.randn(rows, block.gate.in_features,
                            generator=torch.Generator().manual_seed(rows)).bfloat16()
            wants[i, rows] = (x, decode_step.moe_layer(record, i, x))
    monkeypatch.setattr(decode_step._lib, "get",
                        lambda name: getattr(lib, name) if name.startswith("tm_") else get(name))
    for (i, rows), (x, want) in wants.items():
        got = decode_step.moe_layer(record, i, x)
        assert (got.float() - want.float()).norm() <= 2e-3 * want.float().norm(), (i, rows)
    steps = _Steps(engine, monkeypatch)
    assert _generate(engine, BATCH[:3], 12, fused=True) == expected
    assert 3 in steps.rows and 1 in steps.rows


def test_what_the_kernel_does_not_take_keeps_the_module_path(qwen3moe_q8, engines):
    """Float experts (--quantization none), or a top k that torch.topk picks by partial
    sort (k * 64 <= experts: an order moe_step.h does not reproduce), keep the modules,
    and the reason names it."""
    path, _ = qwen3moe_q8
    plain = small_engine(model=str(path), quantization="none")
    assert plain.runner.fused_decode is None
    assert "MoE experts not in GGUF kernel records" in fused_decode.unsupported_reason(
        plain.runner.model, plain.runner.backend, plain.runner.kv_caches)
    runner = engines("qwen3moe_q8").runner
    _, block = _sparse_layers(engines("qwen3moe_q8"))[0]
    block.top_k = 1  # 8 experts, top 1: 64 <= 8 is false, taken; then 2 of 200
    try:
        assert fused_decode.unsupported_reason(runner.model, runner.backend,
                                               runner.kv_caches) is None
        block.experts.num_experts = 200
        assert "top 1 of 200 experts" in fused_decode.unsupported_reason(
            runner.model, runner.backend, runner.kv_caches)
    finally:
        block.top_k, block.experts.num_experts = 2, 8


SYNTHETIC = (Path.home() / ".cache" / "tokenmill-peers" / "models"
             / "qwen3moe-synthetic-12l.Q4_K_M.gguf")


def test_the_synthetic_benchmark_file_gives_the_module_paths_tokens():
    """The real synthetic file (12 layers, 128 experts top 8, Q4_K_M by llama-quantize:
    Q8_0 and Q5_0 downs): batch 1 and a batch of 5, the module path's greedy tokens.
    A peer file: TOKENMILL_TEST_PEER_FILES=1 runs it (issue 59: never in make test)."""
    if os.environ.get("TOKENMILL_TEST_PEER_FILES") != "1":
        pytest.skip("a peer file: TOKENMILL_TEST_PEER_FILES=1 runs it")
    if not SYNTHETIC.exists():
        pytest.skip(f"{SYNTHETIC} not made (python -m benchmarks.peers.synthetic_moe_gguf "
                    "--quantize)")
    engine = small_engine(model=str(SYNTHETIC), quantization="gguf-a16", max_num_seqs=8,
                          kv_cache_mib=64)
    assert engine.runner.fused_decode is not None
    forms = " ".join(f for v in engine.runner.model.weight_forms["linears"].values() for f in v)
    assert "Q8_0" in forms and "Q5_0" in forms, forms
    prompts = ["The capital of France is Paris. The capital of Italy is", "def fib(n):",
               "Once upon a time there", "1, 2, 3, 4,", "Hello"]
    for batch in (prompts[:1], prompts):
        fused = _generate(engine, batch, 16, fused=True)
        assert fused == _generate(engine, batch, 16, fused=False)
