"""Triton kernels (attention's and the layer ops') under the interpreter
(TRITON_INTERPRET=1) on CPU tensors, or compiled on the GPU where CUDA is present
(`kernel_device`).

Triton decides when a function is defined whether it is interpreted, and that
includes its own library (tl.cdiv, tl.sum): so triton and the kernel modules
are imported here, at collection, with the variable set, which is then put back
so that no other test sees it. The `interpreter` fixture sets it again for the
tests that ask for it (the backend checks it). The compile test runs in its own
process, without the variable: interpreted kernels cannot be compiled.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch


def _import_interpreted() -> str | None:
    """None when the kernels are interpreted here; else why not."""
    if importlib.util.find_spec("triton") is None:
        return _NO_TRITON
    already = "triton" in sys.modules
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        from tokenmill.attention.triton import decode, prefill, store_kv
        from tokenmill.kernels import (
            triton_decode_linear,
            triton_fp8_gemm,
            triton_gguf_gemm,
            triton_layer_ops,
            triton_moe,
        )
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    kernels = (tl.cdiv, store_kv.store_kv_kernel, decode.decode_kernel, prefill.prefill_kernel,
               triton_layer_ops._rms_norm_kernel, triton_fp8_gemm._fp8_gemm_kernel,
               triton_moe._fused_moe_kernel, triton_gguf_gemm._gguf_gemm_kernel,
               triton_decode_linear._decode_linear_kernel)
    if not all(isinstance(k, InterpretedFunction) for k in kernels):
        return ("triton was imported before tests/attention/conftest.py could set "
                f"TRITON_INTERPRET=1 (already imported: {already}); run these tests alone")
    return None


_CUDA = torch.cuda.is_available()
_NO_TRITON = "triton is not installed"
_COMPILED = "CUDA is present: the kernels run compiled, on the GPU"
_NOT_INTERPRETED = _COMPILED if _CUDA else _import_interpreted()


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests that need the interpreter itself (CPU tensors through the engine)."""
    if _NOT_INTERPRETED in (_NO_TRITON, _COMPILED):
        pytest.skip(_NOT_INTERPRETED)
    if _NOT_INTERPRETED is not None:
        pytest.fail(_NOT_INTERPRETED)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def kernel_device(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """Where the kernel tests run: the GPU when there is one, else the interpreter."""
    pytest.importorskip("triton")
    if _CUDA:
        return torch.device("cuda")
    if _NOT_INTERPRETED is not None:
        pytest.fail(_NOT_INTERPRETED)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch.device("cpu")
