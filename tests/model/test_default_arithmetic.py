"""Issue 57: the arithmetic `--quantization auto` gives a GGUF file's records, per ISA
(tokenmill/quant/default_arithmetic.py), the flag and the variable that force one, and
the reason the start-up log, /server_info and explain report."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.model.conftest import make_hf_model, write_tiny_gguf
from tokenmill.config import EngineConfig
from tokenmill.engine.core.server_info import server_info
from tokenmill.engine.runner.weights import load_engine_model
from tokenmill.kernels import q4q8_gemv
from tokenmill.loaders import resolve_model
from tokenmill.quant import default_arithmetic, vnni
from tokenmill.quant.default_arithmetic import FORCE_ENV, GATE_PAGE, default_gguf_arithmetic

AVX512_VNNI = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
AVX2 = {"avx2", "fma", "f16c"}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def any_isa(monkeypatch):
    """The rule alone, on any machine: the kernel 'built' with VNNI, nothing forced."""
    monkeypatch.setattr(vnni, "fast", lambda: True)
    monkeypatch.setattr(q4q8_gemv, "has_vnni", lambda: True)
    monkeypatch.delenv(FORCE_ENV, raising=False)


def test_vnni_defaults_to_gguf_a8_avx2_to_gguf_a16_and_one_constant_switches_vnni_back(
        any_isa, monkeypatch):
    # gguf-a8 (attention at int16) passed the full-text gate on every gated file
    on = default_gguf_arithmetic(AVX512_VNNI)
    assert on.reason == f"gguf-a8: default on AVX-512 VNNI (accuracy gate: {GATE_PAGE})"
    assert (REPO / GATE_PAGE).is_file()  # the page it names
    avx2 = default_gguf_arithmetic(AVX2)
    assert avx2.method == "gguf-a16" and "default on AVX2" in avx2.reason
    # a VNNI CPU whose kernel was built without it (e.g. CC for x86-64-v3): not a8
    monkeypatch.setattr(q4q8_gemv, "has_vnni", lambda: False)
    assert default_gguf_arithmetic(AVX512_VNNI).method == "gguf-a16"
    monkeypatch.setattr(q4q8_gemv, "has_vnni", lambda: True)
    # the one-line switch back
    monkeypatch.setattr(default_arithmetic, "A8_DEFAULT_ON_AVX512_VNNI", False)
    off = default_gguf_arithmetic(AVX512_VNNI)
    assert off.method == "gguf-a16" and "A8_DEFAULT_ON_AVX512_VNNI off" in off.reason
    monkeypatch.setattr(vnni, "fast", lambda: False)  # no SIMD build: torch's int4 kernel
    assert default_gguf_arithmetic(AVX512_VNNI).method == "gguf"


def test_the_variable_forces_either_default_and_a_bad_value_is_named(any_isa, monkeypatch):
    for forced in ("gguf-a16", "gguf-a8"):
        monkeypatch.setenv(FORCE_ENV, forced)
        for flags in (AVX512_VNNI, AVX2):
            got = default_gguf_arithmetic(flags)
            assert (got.method, got.reason) == (forced, f"{forced}: forced by {FORCE_ENV}")
    monkeypatch.setenv(FORCE_ENV, "gguf-a4")
    with pytest.raises(ValueError, match=f"{FORCE_ENV}='gguf-a4': use one of gguf-a8"):
        default_gguf_arithmetic(AVX2)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("default-gguf") / "tiny.gguf"
    return resolve_model(str(write_tiny_gguf(make_hf_model("llama"), path)))


@pytest.mark.skipif(not vnni.fast(), reason="the records' kernel is not built with VNNI or AVX2")
def test_auto_resolves_through_the_rule_and_the_flag_wins(tiny_gguf, monkeypatch, caplog):
    """`--quantization auto` (and no flag) load the CPU's default and say why, in the
    start-up log and the weight report /server_info carries; `--quantization gguf-a16`
    still gives the int16 kernel, whatever is forced or the default."""
    monkeypatch.delenv(FORCE_ENV, raising=False)
    default = default_gguf_arithmetic()
    bits = {"gguf-a8": "int8", "gguf-a16": "int16"}
    for requested in (None, "auto"):
        with caplog.at_level(logging.INFO, logger="tokenmill.quant.weight_report"):
            loaded, method = load_engine_model(tiny_gguf, "auto", requested,
                                               torch.device("cpu"))
        assert method == default.method
        assert loaded.model.weight_forms["method_reason"] == default.reason
        assert f"weights ({default.reason})" in caplog.text
        assert bits[method] in {m.activations for m in loaded.model.modules()
                                if hasattr(m, "activations")}
    other = "gguf-a16" if default.method == "gguf-a8" else "gguf-a8"
    monkeypatch.setenv(FORCE_ENV, other)
    loaded, method = load_engine_model(tiny_gguf, "auto", None, torch.device("cpu"))
    assert method == other
    loaded, method = load_engine_model(tiny_gguf, "auto", "gguf-a16", torch.device("cpu"))
    assert method == "gguf-a16"
    assert loaded.model.weight_forms["method_reason"] == "gguf-a16: --quantization gguf-a16"
    assert {m.activations for m in loaded.model.modules() if hasattr(m, "activations")} \
        == {"int16"}


def test_server_info_and_explain_carry_the_reason():
    reason = f"gguf-a8: default on AVX-512 VNNI (accuracy gate: {GATE_PAGE})"
    weights = {"method": "gguf-a8", "method_reason": reason}
    llm = SimpleNamespace(config=EngineConfig(), quantization="gguf-a8",
                          runner=SimpleNamespace(model=SimpleNamespace(weight_forms=weights)))
    info = server_info(llm)
    assert (info["quantization"], info["quantization_reason"]) == ("gguf-a8", reason)
    assert server_info(SimpleNamespace(config=EngineConfig()))["quantization_reason"] is None


def test_the_cli_takes_quantization_auto():
    import argparse

    from tokenmill.cli.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--quantization", "auto"])) \
        .quantization == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "gguf-a4"])
