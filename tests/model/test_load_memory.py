"""The engine's load path holds no float copy of a quantized linear (issue 56).

A ~1B Q4_K_M file peaked at 4.8 GB RSS while loading (1.2 GB resident after): every
quantized linear was dequantized into its float parameter, only for quantize_model
to drop it. These tests load the embedded SmolLM2 file with no large-batch float
copy (`--batched-linears none`, what `auto` picks for a model whose copy exceeds
1 GiB) and fail if any quantized weight is dequantized whole, or if the numpy
allocations live at once ever reach one such weight's float bytes.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from tokenmill.engine.runner.weights import load_engine_model
from tokenmill.loaders import gguf as gguf_loader
from tokenmill.loaders import resolve_model
from tokenmill.loaders.gguf import GGUFTensor, iter_gguf_tensors, open_gguf
from tokenmill.models.deferred_weights import defer, is_deferred, materialize
from tokenmill.quant import vnni
from tokenmill.quant.default_arithmetic import default_gguf_arithmetic


@pytest.fixture(scope="module")
def embedded():
    return resolve_model("smollm2-135m")


def test_load_without_float_copy_dequantizes_no_quantized_weight(embedded, monkeypatch):
    if not vnni.fast():
        pytest.skip("the quantized-activation kernel is not the default path here")
    dequantized: list[str] = []
    real = GGUFTensor.dequantize

    def spy(self: GGUFTensor) -> torch.Tensor:
        if self.is_quantized and len(self.shape) == 2:
            dequantized.append(self.hf_name)
        return real(self)

    monkeypatch.setattr(GGUFTensor, "dequantize", spy)
    monkeypatch.setattr(GGUFTensor, "load", spy)
    # an MLP projection's float32 bytes (3.4 MiB): one such temporary, of any linear
    # but the attention's smaller ones, and the peak passes it
    mlp_float = max(int(np.prod(t.shape)) * 4 for t in iter_gguf_tensors(embedded.path)
                    if t.is_quantized and "mlp" in t.hf_name)
    open_gguf(embedded.path)  # the header's metadata objects are not the weights'
    tracemalloc.start()
    try:
        loaded, method = load_engine_model(embedded, "auto", None, torch.device("cpu"),
                                           batched_linears="none")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert method == default_gguf_arithmetic().method  # the CPU's default records
    assert dequantized == []
    # numpy arrays (a dequantized tensor is one) and Python objects are traced (not
    # torch's own allocations): the model's modules and the loader's bookkeeping come to
    # ~2.2 MiB at the peak; a float copy of the embedding (108 MiB) or of an MLP
    # projection would add its whole size
    assert peak < mlp_float, (peak, mlp_float)
    forms = loaded.model.weight_forms
    assert forms["float_copy_bytes"] == 0
    # nothing left half-loaded: every parameter has its values
    assert not any(is_deferred(p) for p in loaded.model.parameters())


def test_a_deferred_parameter_is_filled_when_asked_and_only_then():
    param = torch.nn.Parameter(torch.empty(4, 3), requires_grad=False)
    calls = []

    def fill() -> None:
        calls.append(1)
        param.data.copy_(torch.arange(12.0).reshape(4, 3))

    defer(param, fill)
    assert is_deferred(param) and param.shape == (4, 3) and calls == []
    assert param.untyped_storage().nbytes() <= param.element_size()  # no storage yet
    materialize(param)
    materialize(param)  # once only
    assert calls == [1] and not is_deferred(param)
    assert torch.equal(param, torch.arange(12.0).reshape(4, 3))


def _mapped_rss_kib(path: str) -> int:
    """Rss of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_copied_blocks_leave_the_file_pages_unmapped(embedded):
    gguf_loader.release_gguf_readers()
    embed = next(t for t in iter_gguf_tensors(embedded.path)
                 if t.hf_name == "model.embed_tokens.weight")
    before = _mapped_rss_kib(str(embedded.path))
    np.asarray(embed.raw).sum()  # read every page of the tensor (29 MiB of Q8_0)
    touched = _mapped_rss_kib(str(embedded.path))
    blocks = embed.raw_blocks()
    after = _mapped_rss_kib(str(embedded.path))
    assert touched - before > 20_000
    # the tensor's own 29 MiB are gone; what may stay is the pages at its two edges that
    # fault-around mapped with it, in folios of up to 2 MiB where the page cache uses large
    # folios (CI's kernel: 1.3 MiB stayed), which belong to the neighbouring tensors
    assert after - before < 4_096 + 1_000, (before, touched, after)
    assert blocks.numel() == embed.raw.nbytes  # the copy itself is whole
    gguf_loader.release_gguf_readers()
