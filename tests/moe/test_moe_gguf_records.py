"""A GGUF file's MoE experts on the quantized-activation kernel (quant/moe_experts.py):
the experts of the files the MoE tests write (Q8_0; Q4_K gate, Q5_K up, Q6_K down) run
their own records, against the dequantized float experts within the kernel's
quantized-activation tolerance; experts nobody routed to are never read; the experts'
resident bytes are about the file's; a type with no record form stays float and is
named."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.moe.conftest import make_hf_moe, write_moe_gguf
from tokenmill.engine.runner.weights import load_engine_model
from tokenmill.kernels import q4q8_gemv
from tokenmill.loaders import load_model, resolve_model
from tokenmill.loaders.gguf import open_gguf
from tokenmill.models.moe import Experts, expert_bytes_read
from tokenmill.quant import moe_experts
from tokenmill.quant.default_arithmetic import default_gguf_arithmetic
from tokenmill.quant.moe_experts import GEMM16_MIN_ROWS, RecordExperts

pytestmark = pytest.mark.skipif(q4q8_gemv.isa() not in ("avx512-vnni", "avx2"),
                                reason="the records' kernel runs only with VNNI or AVX2")
FILES = ["qwen3moe_q8", "mixtral_kquant"]


def _load(path, quantization="gguf-a16"):
    """The engine's model of the file on gguf-a16 (named: these tests hold its int16
    arithmetic, whichever path is the CPU's default)."""
    loaded, _ = load_engine_model(resolve_model(str(path)), "auto", quantization,
                                  torch.device("cpu"))
    return loaded.model


@pytest.fixture(scope="module")
def engine_model(request):
    """which file -> the engine's model of it (dtype auto: bf16, gguf-a16), loaded once."""
    made = {}

    def get(which):
        if which not in made:
            made[which] = _load(request.getfixturevalue(which)[0])
        return made[which]
    return get


def _logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)))).float()


def _expert_file_bytes(path):
    reader = open_gguf(path)
    return sum(int(t.n_bytes) for t in reader.tensors if "_exps" in t.name)


@pytest.mark.parametrize("which", FILES)
def test_experts_run_their_records_and_match_the_float_experts(which, request, monkeypatch,
                                                               engine_model):
    path, _ = request.getfixturevalue(which)
    model = engine_model(which)
    assert not any(isinstance(m, Experts) for m in model.modules())  # no float stacks left
    records = [m for m in model.modules() if isinstance(m, RecordExperts)]
    assert records and all(m.bits == 16 for m in records)
    monkeypatch.setattr(moe_experts, "swap_in", lambda *a: None)  # experts left float
    float_model = _load(path)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2))
    got, expected = _logits(model, ids), _logits(float_model, ids)
    # the same bf16 model but for the experts: the distribution over the next token
    p, q = expected.log_softmax(-1), got.log_softmax(-1)
    assert (p.exp() * (p - q)).sum(-1).max() < 0.02
    assert (expected.argmax(-1) == got.argmax(-1)).float().mean() >= 0.95


@pytest.mark.parametrize("which", FILES)
def test_one_layers_experts_against_the_dequantized_weights(which, request, engine_model):
    """Per layer, one token (the per-row kernel) and every token to two experts (gemm16),
    against float32 experts of the file's dequantized weights: the kernel's bf16 / int16
    activations and requantized Q8 records stay within 2% of the output."""
    path, _ = request.getfixturevalue(which)
    model = engine_model(which)
    reference = load_model(path, dtype="float32").model
    pairs = zip([m for m in model.modules() if isinstance(m, RecordExperts)],
                [m for m in reference.modules() if isinstance(m, Experts)], strict=True)
    for rec, ref in pairs:
        hidden, experts = rec.hidden, rec.num_experts
        for tokens in (1, 3, 2 * GEMM16_MIN_ROWS):
            gen = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, hidden, generator=gen).bfloat16()
            ids = (torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
                   if tokens < GEMM16_MIN_ROWS else torch.tensor([[1, experts - 1]] * tokens))
            weights = torch.rand(tokens, 2, generator=gen)
            got, want = rec(x, weights, ids).float(), ref(x.float(), weights, ids)
            assert got.isfinite().all()
            assert (got - want).norm() <= 0.02 * want.norm(), (tokens, rec)


def test_unrouted_experts_records_are_never_read(engine_model):
    """NaN in every record of the experts a step did not route to: the output is the
    clean one, bit for bit, and the traffic counts only the routed experts' bytes; at
    batch 1 those are the token's k experts."""
    model = engine_model("mixtral_kquant")
    rec = next(m for m in model.modules() if isinstance(m, RecordExperts))
    for ids in (torch.tensor([[2, 5]]), torch.tensor([[0, 3]] * (GEMM16_MIN_ROWS + 1))):
        x = torch.randn(len(ids), rec.hidden, generator=torch.Generator().manual_seed(0))
        x, weights = x.bfloat16(), torch.full(ids.shape, 0.5)
        clean = rec(x, weights, ids)
        unrouted = sorted(set(range(rec.num_experts)) - set(ids.flatten().tolist()))
        saved = {e: (rec.gate_up_records[e].clone(), rec.down_records[e].clone())
                 for e in unrouted}
        for e in unrouted:
            rec.gate_up_records[e].fill_(0xFF)  # every fp16 scale NaN
            rec.down_records[e].fill_(0xFF)
        before, total_before = rec.traffic.bytes_read, expert_bytes_read(model)
        poisoned = rec(x, weights, ids)
        for e, (gu, dn) in saved.items():
            rec.gate_up_records[e].copy_(gu)
            rec.down_records[e].copy_(dn)
        assert torch.equal(poisoned, clean) and clean.isfinite().all()
        routed = set(ids.flatten().tolist())
        assert rec.traffic.bytes_read - before == sum(rec.expert_bytes[e] for e in routed)
        assert expert_bytes_read(model) - total_before == rec.traffic.bytes_read - before


@pytest.mark.parametrize("which,limit", [("qwen3moe_q8", 1.0), ("mixtral_kquant", 1.6)])
def test_experts_resident_bytes_are_about_the_files(which, limit, request, engine_model):
    """The weight report (/server_info's weight_forms) counts the experts' records by
    type and form, and they take about the file's expert bytes: Q8_0 exactly, the
    Q4_K / Q5_K / Q6_K file at most 1.6x (4/5-bit record forms, Q6_K's 8-bit one);
    no float copy of any expert is kept."""
    path, _ = request.getfixturevalue(which)
    model = engine_model(which)
    report = model.weight_forms
    records = sum(m.records_bytes() for m in model.modules() if isinstance(m, RecordExperts))
    file_bytes = _expert_file_bytes(path)
    assert file_bytes <= records <= limit * file_bytes
    assert records <= report["lowbit_bytes"]
    layers = len([m for m in model.modules() if isinstance(m, RecordExperts)])
    experts = next(m for m in model.modules() if isinstance(m, RecordExperts)).num_experts
    assert sum(report["linears"]["experts.gate_up"].values()) == layers * experts
    assert sum(report["linears"]["experts.down"].values()) == layers * experts
    if which == "mixtral_kquant":
        assert "Q4_K+Q5_K as" in next(iter(report["linears"]["experts.gate_up"]))
        assert "Q6_K as q8 requantized" in report["linears"]["experts.down"]
    assert not any("experts" in name for name, _ in model.named_parameters())
    assert not report["kept_float"]


def test_experts_of_a_type_without_records_stay_float_and_are_named(tmp_path, caplog,
                                                                   monkeypatch):
    """Q2_K experts (no record form): the dequantized float experts run, and the log
    names the type and the layers, as for a dense linear of that type."""
    from tests.model import test_gguf_types

    monkeypatch.setitem(test_gguf_types.K_QUANTS, "Q2_K", (84, {80: 0.15 / 45, 82: 0.15 / 45}))
    hf = make_hf_moe("mixtral", num_local_experts=4, intermediate_size=256, hidden_size=256,
                     num_attention_heads=4, num_key_value_heads=2)
    path = write_moe_gguf(hf, tmp_path / "q2k.gguf", ("Q4_K", "Q4_K", "Q2_K"))
    with caplog.at_level(logging.INFO, logger="tokenmill.quant.weight_report"):
        model = _load(path)
    kept = model.weight_forms["kept_float"]
    assert sorted(kept) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert "Q2_K has no native kernel" in caplog.text
    assert "model.layers.0.mlp.experts" in caplog.text
    assert any(isinstance(m, Experts) for m in model.modules())
    assert _logits(model, torch.arange(8)).isfinite().all()


def test_auto_runs_the_experts_records_on_the_cpus_default_arithmetic(qwen3moe_q8):
    """--quantization auto on an MoE file: the CPU's default (gguf-a8 on AVX-512 VNNI,
    gguf-a16 on AVX2: default_arithmetic.py), its activations' precision in the experts'
    records too."""
    default = default_gguf_arithmetic()
    loaded, method = load_engine_model(resolve_model(str(qwen3moe_q8[0])), "auto", "auto",
                                       torch.device("cpu"))
    assert method == default.method
    records = [m for m in loaded.model.modules() if isinstance(m, RecordExperts)]
    assert records and all(m.bits == {"gguf-a8": 8, "gguf-a16": 16}[method] for m in records)
    assert loaded.model.weight_forms["method_reason"] == default.reason


def test_batch1_decode_reads_only_the_routed_experts(qwen3moe_q8):
    """Generation through the engine: the experts' bytes read (the engine's stats, what
    explain holds against the active-expert floor) are those of k experts per sparse
    layer and token, far below every expert's."""
    from tokenmill import LLM, SamplingParams

    path, _ = qwen3moe_q8
    llm = LLM(str(path), max_num_seqs=1)
    rec = [m for m in llm.engine.runner.model.modules() if isinstance(m, RecordExperts)]
    assert rec
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=9, temperature=0.0,
                                                   ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 9
    read = llm.engine.get_stats().moe_expert_bytes
    per_expert, top_k = rec[0].expert_bytes[0], 2
    assert all(b == per_expert for m in rec for b in m.expert_bytes)
    # the prompt (3 tokens) and 8 decode steps: at most k experts a token, per layer
    assert 8 * top_k * per_expert * len(rec) <= read <= 11 * top_k * per_expert * len(rec)


def test_experts_on_records_are_never_dequantized_at_load(qwen3moe_q8, monkeypatch):
    """The float stacks of experts that run in records are never written (the load's
    peak stays near the file's bytes): no stacked expert tensor is dequantized."""
    from tokenmill.loaders import model_loader
    from tokenmill.loaders.gguf import GGUFTensor

    def refuse(*args):
        raise AssertionError("a stacked expert tensor was dequantized")

    dequantize = GGUFTensor.load
    monkeypatch.setattr(GGUFTensor, "load", lambda self: refuse() if len(self.shape) == 3
                        else dequantize(self))
    monkeypatch.setattr(model_loader, "_dequantized", refuse)
    model = _load(qwen3moe_q8[0])
    assert any(isinstance(m, RecordExperts) for m in model.modules())
    assert _logits(model, torch.arange(6)).isfinite().all()


def test_the_avx2_build_runs_the_experts_records(engine_model, monkeypatch):
    """An AVX-512 machine builds and runs the AVX2 (x86-64-v3) kernel too: the same
    experts' records through it, per-row (few tokens) and gemm16 (many), give the VNNI
    build's outputs within the activations' rounding."""
    from tests.model.conftest import load_for_march

    model = engine_model("mixtral_kquant")
    rec = next(m for m in model.modules() if isinstance(m, RecordExperts))
    avx2 = load_for_march(q4q8_gemv._lib, "x86-64-v3")
    assert avx2.tm_q4q8_isa() == 1
    monkeypatch.setattr(q4q8_gemv._lib, "get", lambda name: getattr(avx2, name))
    on_avx2 = RecordExperts(list(zip(rec.gate_up_records, rec.gate_up_formats, strict=True)),
                            list(zip(rec.down_records, rec.down_formats, strict=True)),
                            rec.hidden, rec.intermediate, 16, {})
    for tokens in (1, 3, 2 * GEMM16_MIN_ROWS):
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, rec.hidden, generator=gen).bfloat16()
        ids = torch.tensor([[1, rec.num_experts - 1]] * tokens)
        weights = torch.rand(tokens, 2, generator=gen)
        got = on_avx2(x, weights, ids).float()
        monkeypatch.undo()
        want = rec(x, weights, ids).float()
        monkeypatch.setattr(q4q8_gemv._lib, "get", lambda name: getattr(avx2, name))
        assert (got - want).norm() <= 2e-3 * want.norm(), tokens
