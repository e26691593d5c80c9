"""The fused batch-1 decode step (engine/fused_decode.py) on shapes the embedded model
does not have: tiny random GGUF Llamas with other head sizes and kv groups, a Q8_0 / Q4_1
fused QKV, and untied or tied heads, against the module path step by step."""

from __future__ import annotations

import pytest
import torch

from tests.model.conftest import make_hf_model, save_hf, write_tiny_gguf
from tokenmill.engine.runner import weights
from tokenmill.engine.runner.model_runner import ModelRunner, StepInputs
from tokenmill.kernels import decode_step, q4q8_gemv
from tokenmill.loaders import resolve_model

pytestmark = pytest.mark.skipif(not (decode_step.available() and q4q8_gemv.available()),
                                reason="decode_step not built")
BLOCK = 16
SHAPES = {  # head_dim 16, 2 query heads per kv head (the plain-C attention tiles)
    "d16-g2": {},
    # head_dim 128, 4 query heads per kv head (the AVX512-BF16 tiles), tied head
    "d128-g4-tied": {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1,
                     "intermediate_size": 256, "tie_word_embeddings": True},
    # head_dim 256 (Gemma 3's), 4 and 2 query heads per kv head: the attention's V sums in
    # passes of the head dimension, the tiles unrolled at compile time
    "d256-g4": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
                "head_dim": 256, "intermediate_size": 256},
    "d256-g2": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 256, "intermediate_size": 256},
}


def _runner(tmp_path, overrides, q8_0=("embed_tokens", "down_proj"),
            quantization="gguf-a16", batched_linears="auto") -> ModelRunner:
    # v in Q4_1 like q and k: a fused QKV of mixed types has no exact quantized-activation
    # form, so it keeps bf16 activations and the fused step is not taken (the first test)
    path = write_tiny_gguf(make_hf_model("llama", **overrides), tmp_path / "tiny.gguf",
                           q8_0=q8_0)
    loaded, method = weights.load_engine_model(resolve_model(str(path)), "bfloat16",
                                               quantization, torch.device("cpu"),
                                               batched_linears=batched_linears)
    assert method == quantization
    return ModelRunner(loaded.model, loaded.config, BLOCK, 8, torch.bfloat16,
                       torch.device("cpu"), "cpu")


def _step(runner: ModelRunner, ids: list[int], start: int, table: list[int],
          fresh: list[int]) -> torch.Tensor:
    n = len(ids)
    positions = list(range(start, start + n))
    inputs = StepInputs(ids, positions, [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions],
                        [0, n], [start + n], [n], [table], fresh, [n - 1])
    ids_t, pos, meta, rows = runner.upload(runner.stage_inputs(inputs))
    return runner.forward(ids_t, pos, meta, rows)


def test_a_qkv_of_mixed_gguf_types_runs_the_fused_step(tmp_path):
    """A Q4 q/k beside a Q8_0 v (llama-quantize's files mix them): each part keeps its
    own record format (issue 56) and the fused step still serves the layer, with the module
    path's logits."""
    runner = _runner(tmp_path, {}, q8_0=("embed_tokens", "v_proj", "down_proj"))
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.vnni_format == q4q8_gemv.FORMAT_MIXED  # q, k 4-bit beside an 8-bit v
    _decode_both_ways(runner, runner.fused_decode)


def test_a_tied_embedding_read_from_the_lm_heads_records_runs_the_fused_step(tmp_path):
    """No float copy (memory that scales): a tied embedding's rows come from the LM
    head's records (kept once, issue 56), in the fused step as in the modules."""
    from tokenmill.quant.embedding import RecordsEmbedding

    runner = _runner(tmp_path, SHAPES["d128-g4-tied"], batched_linears="none")
    assert isinstance(runner.model.model.embed_tokens, RecordsEmbedding)
    _decode_both_ways(runner, runner.fused_decode, exact=True)


@pytest.mark.parametrize("threads", [1, 2])  # 2: a kv head's query heads split in two
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_steps_match_the_module_path_on_other_shapes(tmp_path, shape, threads,
                                                           monkeypatch):
    calls = []
    step = decode_step.step
    monkeypatch.setattr(decode_step, "step", lambda *a: calls.append(1) or step(*a))
    runner = _runner(tmp_path, SHAPES[shape])
    fused = runner.fused_decode
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _decode_both_ways(runner, fused)
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 2 * BLOCK + 3 - 7  # every decode step after the 7-token prompt


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_bf16_models_fused_steps_give_the_module_paths_bits(tmp_path, shape, monkeypatch):
    """`--quantization none`: every linear and the head as bf16_gemv.c's rows inside the
    call, on the plain-C and the AVX512-BF16 attention tiles, 3 threads (uneven shares)."""
    calls = []
    step = decode_step.step
    monkeypatch.setattr(decode_step, "step", lambda *a: calls.append(1) or step(*a))
    runner = _runner(tmp_path, SHAPES[shape], quantization="none")
    assert runner.fused_decode is not None and runner.fused_decode.plain
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        _decode_both_ways(runner, runner.fused_decode, exact=True)
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 2 * BLOCK + 3 - 7


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_bf16_models_biases_are_added_inside_the_fused_step(tmp_path, arch):
    """Qwen2's q/k/v biases (Llama's attention_bias: q/k/v and o), from a bf16 HF
    checkpoint: the fused step adds them before rounding, as the modules' GEMV does."""
    overrides = {"attention_bias": True} if arch == "llama" else {}
    path = save_hf(make_hf_model(arch, **overrides).bfloat16(), tmp_path / arch)
    loaded, method = weights.load_engine_model(resolve_model(str(path)), "bfloat16", "none",
                                               torch.device("cpu"))
    assert method == "none"
    runner = ModelRunner(loaded.model, loaded.config, BLOCK, 8, torch.bfloat16,
                         torch.device("cpu"), "cpu")
    fused = runner.fused_decode
    assert fused is not None and fused.plain
    layer = fused.record.layers[0]
    assert layer.qkv_bias and bool(layer.o_bias) == (arch == "llama")
    assert not layer.gate_up_bias and not layer.down_bias
    _decode_both_ways(runner, fused, exact=True)


def _decode_both_ways(runner: ModelRunner, fused, exact: bool = False) -> None:
    assert fused is not None
    table = [3, 1, 6]  # not in order: the step reads blocks through the table
    prompt = [5, 17, 200, 33, 9, 101, 64]
    logits = _step(runner, prompt, 0, table, fresh=table)  # prefill: the modules
    token, pos = int(logits[-1].argmax()), len(prompt)
    while pos < 2 * BLOCK + 3:  # decode across two block boundaries
        fused.enabled = False
        expected = _step(runner, [token], pos, table, [])
        fused.enabled = True
        got = _step(runner, [token], pos, table, [])  # writes the same K/V over the slot
        if exact:
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        token, pos = int(got[0].argmax()), pos + 1


def test_its_build_is_keyed_on_the_kernels_it_compiles_in():
    # decode_step.c #includes q4q8_gemv.c, paged_decode.c and bf16_gemv.c: an edit there
    # must rebuild it
    from pathlib import Path

    from tokenmill.kernels import build

    kernels = Path(build.__file__).parent
    included = build._included_sources(kernels / "decode_step.c")
    assert included == [(kernels / n).read_text() for n in ("q4q8_gemv.c", "paged_decode.c",
                                                             "bf16_gemv.c")]
    assert build._included_sources(kernels / "layer_ops.c") == []


@pytest.mark.parametrize("march, needs", [("x86-64-v3", {"avx2", "fma", "f16c"}),
                                          ("x86-64-v2", set())], ids=["avx2", "plain"])
def test_it_builds_for_cpus_without_avx512(march, needs):
    """decode_step.c with every kernel it includes, built as a CPU without AVX-512 builds
    it (strict fp32 flags; AVX2, or plain x86-64): it compiles, links and loads with the
    ABI the Python side expects. An x86 intrinsic used outside its ISA's #if (the first
    version of the next layer's K/V prefetch) compiled only for AVX2 and AVX-512."""
    import ctypes
    import platform
    from pathlib import Path

    from tests.model.conftest import build_for_march
    from tokenmill.cpuinfo import cpu_flags

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 build needs an x86 host")
    path = build_for_march(Path(decode_step.__file__).with_name("decode_step.c"), march)
    assert path is not None
    if not needs <= cpu_flags():
        return  # built; this CPU cannot load it
    lib = ctypes.CDLL(str(path))
    lib.tm_decode_step_abi.restype = ctypes.c_int64
    assert lib.tm_decode_step_abi() == decode_step._lib.get("tm_decode_step_abi")()
