"""Issue 56 on real files: the embedded SmolLM2 GGUF (its tied Q8_0 embedding read from
the LM head's records when no float copy is kept) and llama-quantize's SmolLM2 Q4_K_M /
Q5_K_M / Q6_K files (5-bit Q5_0 / Q5_K and 8-bit Q6_K records, Q4_K's own super-blocks,
q/k beside v in their own formats): the fused decode step gives the module path's greedy tokens. The peer
files (`python -m benchmarks.peers.make_smollm2_quants`) run only on request,
TOKENMILL_TEST_PEER_FILES=1 (issue 56: peers never run in make test)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.engine.conftest import small_engine
from tests.engine.test_fused_decode import _greedy
from tokenmill.kernels import decode_step, q4q8_gemv

pytestmark = pytest.mark.skipif(not (decode_step.available() and q4q8_gemv.available()),
                                reason="decode_step not built")
MODELS = Path.home() / ".cache" / "tokenmill-peers" / "models"
PROMPT = "The capital of France is Paris. The capital of Italy is"
# file -> record forms its linears must show (none widened to 8 bits but Q6_K's own)
FILES = {"embedded": (),
         "smollm2-135m-Q4_K_M.gguf": ("q5 exact", "q8 requantized", "q4k exact"),
         "smollm2-135m-Q5_K_M.gguf": ("q5 exact",),
         "smollm2-135m-Q6_K.gguf": ("q8 requantized",)}


@pytest.mark.parametrize("name", list(FILES))
def test_fused_steps_give_the_module_paths_greedy_tokens_on_real_files(name):
    from tokenmill.quant.embedding import RecordsEmbedding

    if name == "embedded":
        # no float copy: the tied embedding's rows come from the LM head's records
        engine = small_engine(quantization="gguf-a16", batched_linears="none")
        assert isinstance(engine.runner.model.model.embed_tokens, RecordsEmbedding)
    else:
        path = MODELS / name
        if os.environ.get("TOKENMILL_TEST_PEER_FILES") != "1":
            pytest.skip("a peer file: TOKENMILL_TEST_PEER_FILES=1 runs it")
        if not path.exists():
            pytest.skip(f"{path} not made (python -m benchmarks.peers.make_smollm2_quants)")
        engine = small_engine(model=str(path), quantization="gguf-a16")
    assert engine.runner.fused_decode is not None
    keys = [f for v in engine.runner.model.weight_forms["linears"].values() for f in v]
    forms = " ".join(keys)
    for form in FILES[name]:
        assert form in forms, forms
    assert all("Q6_K" in k for k in keys if "q8 requantized" in k), forms
    fused = _greedy(engine, PROMPT, 24, fused=True)
    assert fused == _greedy(engine, PROMPT, 24, fused=False)
    assert len(set(fused)) > 3  # a real continuation, not one token repeated
