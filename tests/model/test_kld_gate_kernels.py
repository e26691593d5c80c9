"""The KLD gate scores gguf-a8 through its own kernel (issue 57): at prompt-sized steps
gguf-a16 and gguf-a8 both run the packed bf16 weights (the same logits, so the gate
could not tell them apart), while with the scored half in 16-row steps each path's
linears run its per-row quantized-activation kernel (int16 / int8 activations, what
its decode steps run) and their logits differ. routes.py names which kernel ran, and
its reading of Int4Linear's choice is held to the module's own dispatch."""

from __future__ import annotations

import pytest
import torch

from benchmarks.accuracy_gate import routes
from benchmarks.accuracy_gate.chunks import Chunking
from benchmarks.accuracy_gate.tokenmill_runs import (
    build_engine,
    prefill_chunks,
    prefill_flags,
    split_gate_flags,
)
from tokenmill.quant import vnni
from tokenmill.quant.model import VNNI_DENSE_MIN_ROWS

pytestmark = pytest.mark.skipif(not vnni.available(), reason="q4q8_gemv not built")

CHUNKING = Chunking(64)  # first half 32 rows (>= VNNI_DENSE_MIN_ROWS), 31 scored


def _scored(engine, chunk: list[int], step_rows: int | None):
    got: dict[int, torch.Tensor] = {}

    def sink(rows, logp):
        got.update(zip(rows.tolist(), logp.clone(), strict=True))

    with routes.counting() as seen:
        prefill_chunks(engine, [chunk], CHUNKING, sink, step_rows)
    assert sorted(got) == list(range(CHUNKING.scored_per_chunk))
    return torch.stack([got[i] for i in sorted(got)]), dict(seen)


@pytest.fixture(scope="module")
def scored():
    from tokenmill.loaders.model_source import resolve_model
    from tokenmill.loaders.tokenizer import load_tokenizer

    text = ("Light which differs in Colour, differs also in Degrees of Refrangibility. "
            "The Phaenomena of Colours in refracted or reflected Light are not caused by "
            "new Modifications of the Light variously impress'd.")
    ids = load_tokenizer(resolve_model("smollm2-135m")).encode(text, add_special_tokens=False)
    chunk = (ids * 4)[:CHUNKING.n_ctx]
    out = {}
    for method in ("gguf-a16", "gguf-a8"):
        engine = build_engine("smollm2-135m",
                              f"{prefill_flags(CHUNKING)} --quantization {method}")
        try:
            out[method, "prompt"] = _scored(engine, chunk, None)
            out[method, "decode"] = _scored(engine, chunk, 16)
            out[method, "model"] = engine.runner.model
        finally:
            engine.close()
    return out


def test_prompt_steps_give_gguf_a16_and_a8_the_same_dense_weights(scored):
    (a16, r16), (a8, r8) = scored["gguf-a16", "prompt"], scored["gguf-a8", "prompt"]
    assert torch.equal(a16, a8)
    assert all(k.startswith("dense") for k in (*r16, *r8)), (r16, r8)


def test_decode_rows_run_each_paths_own_kernel(scored):
    (a16, r16), (a8, r8) = scored["gguf-a16", "decode"], scored["gguf-a8", "decode"]
    # gguf-a8: int8 into the MLP (and the head), int16 into the attention's two linears
    assert r8.get("kernel int8", 0) >= r8.get("kernel int16", 0) > 0, r8
    assert r16.get("kernel int16", 0) > 0 and "kernel int8" not in r16, r16
    assert not torch.equal(a16, a8)          # int8 vs int16 activations
    dense = scored["gguf-a8", "prompt"][0]
    assert not torch.equal(a8, dense)        # and not the prompt's bf16 weights
    # ...yet close: the same model, the same weights (a user would see a tie break)
    assert (a8.exp() * (a8 - dense)).sum(-1).mean() < 0.05


def test_route_reading_matches_int4linears_dispatch(scored):
    """routes.route names the branch Int4Linear takes: kernel below dense_min_rows,
    the dense weight from it (the output equals that branch's own call): packed bf16
    for an attention linear, the MLP's own int8 records for an MLP linear under
    `--batched-linears auto` on AVX512-VNNI (mlp-int8)."""
    from tokenmill.quant import mlp_int8
    from tokenmill.quant.linear import Int4Linear

    linears = {name.rpartition(".")[2]: x for name, x in
               scored["gguf-a8", "model"].named_modules()
               if isinstance(x, Int4Linear) and x.activations in ("int8", "int16")}
    mlp_dense = ("dense int8 records" if mlp_int8.available()
                 else "dense bfloat16")
    for leaf, dense in (("qkv_proj", "dense bfloat16"), ("down_proj", mlp_dense)):
        m = linears[leaf]
        for rows in (1, VNNI_DENSE_MIN_ROWS - 1, VNNI_DENSE_MIN_ROWS, 64):
            x = torch.randn(rows, m.in_features, dtype=torch.bfloat16)
            name = routes.route(m, rows)
            assert name == (f"kernel {m.activations}" if rows < VNNI_DENSE_MIN_ROWS
                            else dense), (leaf, rows)
            want = m._lowbit(x) if name.startswith("kernel") else m.dense(x)
            assert torch.equal(m(x), want.to(torch.bfloat16)), (leaf, rows, name)


def test_gate_flags_are_split_from_engine_flags():
    assert split_gate_flags("--quantization gguf-a8 --scored-step-rows 16") == (
        "--quantization gguf-a8", 16)
    assert split_gate_flags("--kv-cache-dtype int8") == ("--kv-cache-dtype int8", None)
    with pytest.raises(ValueError, match="--scored-step-rows"):
        split_gate_flags("--scored-step-rows x")
