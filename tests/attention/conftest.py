"""Triton kernels under the interpreter (TRITON_INTERPRET=1) on CPU tensors.

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


def _import_interpreted() -> str | None:
    """None when the kernels are interpreted here; else why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    already = "triton" in sys.modules
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        from tokenmill.attention.triton import decode, prefill, store_kv
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    kernels = (tl.cdiv, store_kv.store_kv_kernel, decode.decode_kernel, prefill.prefill_kernel)
    if not all(isinstance(k, InterpretedFunction) for k in kernels):
        return ("triton was imported before tests/attention/conftest.py could set "
                f"TRITON_INTERPRET=1 (already imported: {already}); run these tests alone")
    return None


_NOT_INTERPRETED = _import_interpreted()


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if _NOT_INTERPRETED == "triton is not installed":
        pytest.skip(_NOT_INTERPRETED)
    if _NOT_INTERPRETED is not None:
        pytest.fail(_NOT_INTERPRETED)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
