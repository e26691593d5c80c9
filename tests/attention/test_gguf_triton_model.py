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


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_without_a_float_copy_a_prompt_runs_on_the_blocks_dequantized(kernel_device,
                                                                       tmp_path, qtype):
    """--batched-linears none (auto's choice past FLOAT_COPY_LIMIT_BYTES): no linear keeps
    a dense weight, the engine's load never fills one, and a prompt of more rows than a
    decode batch (70 > MAX_ROWS) gets the dequantized model's logits, as 9 rows do."""
    from tokenmill.kernels import triton_gguf_gemm
    from tokenmill.loaders import load_model
    from tokenmill.models.deferred_weights import is_deferred
    from tokenmill.quant import quantize_model
    from tokenmill.quant.gguf_triton import GgufTritonLinear

    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(path, qtype)
    want_model = load_model(path, dtype="float32", device=kernel_device).model
    model = load_model(path, dtype="float32", device=kernel_device,
                       defer_quantized=True).model  # as the engine loads it
    rows = triton_gguf_gemm.MAX_ROWS + 6
    ids = torch.randint(0, VOCAB, (rows,), generator=torch.Generator().manual_seed(5))
    ids, pos = ids.to(kernel_device), torch.arange(rows, device=kernel_device)
    with torch.no_grad():
        summary = quantize_model(model, "gguf-triton", batched_linears="none")
        linears = [m for m in model.modules() if isinstance(m, GgufTritonLinear)]
        assert len(linears) == 9 and all(m.weight is None for m in linears)
        assert summary.dense_bytes == 0
        assert not any(is_deferred(p) for p in model.parameters())  # none left pending
        for n in (rows, 9):  # a prompt's rows (dequantized), a decode batch's (blocks)
            want = want_model.compute_logits(want_model(ids[:n], pos[:n]))
            got = model.compute_logits(model(ids[:n], pos[:n]))
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_0"])
def test_dequantize_writes_the_gguf_packages_weights(kernel_device, qtype):
    """triton_gguf_gemm.dequantize into a slice of a NaN-filled buffer: the `gguf`
    package's values in its rows, nothing written outside them."""
    import gguf

    from benchmarks.gguf_gemm_rows import random_blocks
    from tokenmill.kernels import triton_gguf_gemm

    n, k = 40, 512
    blocks = random_blocks(qtype, n, k, seed=7)
    want = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]))
    dtype = torch.bfloat16 if kernel_device.type == "cuda" else torch.float32
    buf = torch.full((n + 3, k + 5), float("nan"), dtype=dtype, device=kernel_device)
    assert triton_gguf_gemm.dequantize(torch.from_numpy(blocks).to(kernel_device), qtype, k,
                                       buf[1:n + 1, :k])
    torch.testing.assert_close(buf[1:n + 1, :k].float().cpu(), want.to(dtype).float(),
                               rtol=0, atol=0)
    assert buf[0].isnan().all() and buf[n + 1:].isnan().all() and buf[:, k:].isnan().all()
    assert not triton_gguf_gemm.dequantize(torch.from_numpy(blocks).to(kernel_device), qtype,
                                           k, buf[:n, :k - 1])  # the wrong shape: refused


def test_asked_for_on_cpu_without_the_interpreter_is_an_error(monkeypatch):
    from tokenmill.quant import resolve_method

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="gguf-triton.*CUDA"):
        resolve_method("gguf-triton", torch.nn.Linear(4, 4))


def test_on_the_gpu_auto_keeps_a_float_copy_only_while_it_is_small():
    """gguf-triton's large batches: --batched-linears auto keeps the bf16 copy under
    FLOAT_COPY_LIMIT_BYTES (a small model's prompts on cuBLAS at no dequantization), none
    past it (an 8B Q4_K_M's 14 GiB copy would triple the GPU memory its 4.6 GiB of blocks
    take); bf16 and none are what they say; the CPU kernels' forms are refused."""
    from tokenmill.quant.model import FLOAT_COPY_LIMIT_BYTES, resolve_batched_linears

    def resolve(requested, copy):
        return resolve_batched_linears(requested, "gguf-triton", torch.bfloat16, True, copy)

    assert resolve("auto", FLOAT_COPY_LIMIT_BYTES // 2) == "bf16"
    assert resolve("auto", 14 << 30) == "none"
    assert resolve("bf16", 14 << 30) == "bf16" and resolve("none", 1 << 20) == "none"
    for cpu_only in ("int8", "mlp-int8", "int16", "w8a8"):
        with pytest.raises(ValueError, match=f"--batched-linears {cpu_only}"):
            resolve(cpu_only, 1 << 20)
