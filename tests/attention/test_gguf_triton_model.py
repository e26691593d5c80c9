"""A whole GGUF model with its linears swapped for GgufTritonLinear (quantization
gguf-triton: the blocks read by triton_gguf_gemm) gives the logits of the loader's
dequantized weights, on the tiny Llama of tests/model/test_gguf_types.py written in
each type the kernel reads. Under the interpreter on CPU (fp32), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_gguf_types import VOCAB, write_gguf


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_0"])
def test_logits_match_the_dequantized_model(kernel_device, tmp_path, qtype):
    from tokenmill.loaders import load_model
    from tokenmill.quant import quantize_model, resolve_method
    from tokenmill.quant.gguf_triton import GgufTritonLinear

    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(path, qtype)
    loaded = load_model(path, dtype="float32", device=kernel_device)
    model = loaded.model
    if kernel_device.type == "cpu":  # the automatic choice is the GPU's only
        assert resolve_method(None, model, "auto") != "gguf-triton"
    ids = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3))
    ids, pos = ids.to(kernel_device), torch.arange(9, device=kernel_device)
    with torch.no_grad():
        want = model.compute_logits(model(ids, pos))
        summary = quantize_model(model, "gguf-triton")
        got = model.compute_logits(model(ids, pos))
    swapped = [n for n, m in model.named_modules() if isinstance(m, GgufTritonLinear)]
    # qkv, o, gate_up, down per layer (2 layers), and the LM head
    assert len(swapped) == 9 and summary.quantized == swapped, summary.kept_float
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_asked_for_on_cpu_without_the_interpreter_is_an_error(monkeypatch):
    from tokenmill.quant import resolve_method

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="gguf-triton.*CUDA"):
        resolve_method("gguf-triton", torch.nn.Linear(4, 4))
