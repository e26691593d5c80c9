"""Issue 58: the fused native decode step (kernels/decode_step.c) serves Gemma 3 layers
(per-head q/k norms, the norms of the attention and MLP outputs, per-layer RoPE tables,
GeGLU, sliding windows, the embedding scale) and Qwen3's q/k norms, with the module
path's tokens and logits: a tiny random Gemma 3 (window 8, block size 8) decoding far
past its window, alone and batched, a tiny random Qwen3, and the AVX2 build of the step.
The real gemma3-270m file: tests/model/test_gemma3_file_fused.py."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_gemma3 import WINDOW, _randomize, _text_config
from tokenmill.engine.runner import fused_decode
from tokenmill.kernels import decode_step
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not decode_step.available(), reason="decode_step not built")
VOCAB = 49152  # SmolLM2's tokenizer, saved with each checkpoint
# prompts inside the window, crossing it while decoding, and far past it (block size 8)
_GEN = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(3, VOCAB, (n,), generator=_GEN).tolist() for n in (5, 20, 44)]


def _save_tokenizer(path) -> None:
    from tokenmill.loaders import load_tokenizer, resolve_model

    load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(path)


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory) -> str:
    from transformers import Gemma3ForCausalLM

    model = Gemma3ForCausalLM(_text_config(VOCAB)).eval()
    _randomize(model)
    path = tmp_path_factory.mktemp("gemma3-fused")
    model.save_pretrained(path)
    _save_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory) -> str:
    from tests.model.conftest import make_hf_model

    model = make_hf_model("qwen3", head_dim=32, vocab_size=VOCAB)
    path = tmp_path_factory.mktemp("qwen3-fused")
    model.save_pretrained(path)
    _save_tokenizer(path)
    return str(path)


def _llm(path: str):
    from tokenmill import LLM

    # a bf16 model: every linear bf16_gemv.c's inside the call, the module path's rows
    return LLM(path, dtype="bfloat16", quantization="none", attention_backend="cpu",
               block_size=8, max_num_seqs=4, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return _llm(gemma_path)


class _Steps:
    """Every step's logits (and seq lengths), and how many rows took the fused call."""

    def __init__(self, llm, monkeypatch: pytest.MonkeyPatch) -> None:
        self.logits: list[torch.Tensor] = []
        self.fused_rows: list[int] = []
        runner = llm.engine.runner
        forward, step, step_batch = runner.forward, decode_step.step, decode_step.step_batch

        def record(*args):
            out = forward(*args)
            self.logits.append(out.clone())
            return out

        def count(*args):
            self.fused_rows.append(1)
            return step(*args)

        def count_batch(model, tokens, *args):
            self.fused_rows.append(tokens.shape[0])
            return step_batch(model, tokens, *args)

        monkeypatch.setattr(runner, "forward", record)
        monkeypatch.setattr(decode_step, "step", count)
        monkeypatch.setattr(decode_step, "step_batch", count_batch)


def _generate(llm, prompts: list[list[int]], n: int, fused: bool) -> list[list[int]]:
    llm.engine.runner.fused_decode.enabled = fused
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        llm.engine.runner.fused_decode.enabled = True
    return [list(o.outputs[0].token_ids) for o in outs]


def _compare(llm, prompts, n, monkeypatch, same_tokens: bool = True
             ) -> tuple[list[int], float]:
    """Fused vs module path on `prompts` together: the same tokens; returns the fused
    call's rows per step and the largest logit difference of the steps past the window
    (inside it every step must be bit for bit the module path's)."""
    rec = _Steps(llm, monkeypatch)
    fused_ids = _generate(llm, prompts, n, fused=True)
    fused_logits, rows = list(rec.logits), list(rec.fused_rows)
    rec.logits.clear()
    rec.fused_rows.clear()
    module_ids = _generate(llm, prompts, n, fused=False)
    assert rec.fused_rows == []
    assert fused_ids == module_ids or not same_tokens
    assert len(fused_logits) == len(rec.logits)
    worst = 0.0
    longest = max(len(p) for p in prompts)
    for step, (a, b) in enumerate(zip(fused_logits, rec.logits, strict=True)):
        if longest + step <= WINDOW and same_tokens:
            assert torch.equal(a, b), f"step {step} inside the window"
        worst = max(worst, (a - b).abs().max().item())
    return rows, worst


def test_the_fused_step_serves_gemma(gemma):
    runner = gemma.engine.runner
    assert fused_decode.unsupported_reason(runner.model, runner.backend,
                                           runner.kv_caches) is None
    fused = runner.fused_decode
    windows = [fused.record.layers[i].window for i in range(4)]
    assert windows == [WINDOW, WINDOW, 0, WINDOW]
    assert fused.record.act == decode_step.ACT_GELU_TANH


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_one_sequence_past_the_window_gives_the_module_paths_tokens(gemma, prompt,
                                                                   monkeypatch):
    rows, worst = _compare(gemma, [PROMPTS[prompt]], 40, monkeypatch)
    print("worst", worst)
    assert rows == [1] * 39  # every step after the prompt's
    # past the window the module path's cpu backend attends in torch (window.py): the
    # same softmax over the same keys, summed in another order
    assert worst < 0.05, worst


def test_a_batch_past_the_window_gives_the_module_paths_tokens(gemma, monkeypatch):
    rows, worst = _compare(gemma, PROMPTS, 40, monkeypatch)
    assert max(rows) == 3
    assert worst < 0.05, worst


def test_the_window_is_what_the_fused_step_attends_over(gemma, monkeypatch):
    """The comparison above can fail: the fused step with its windows cleared (every
    layer global) parts from the module path past the window."""
    fused = gemma.engine.runner.fused_decode
    saved = [fused.record.layers[i].window for i in range(4)]
    for i in range(4):
        fused.record.layers[i].window = 0
    try:
        _, worst = _compare(gemma, [PROMPTS[2]], 8, monkeypatch, same_tokens=False)
    finally:
        for i, w in enumerate(saved):
            fused.record.layers[i].window = w
    assert worst > 0.5, worst


def test_qwen3_q_k_norms_run_fused_with_the_module_paths_tokens(qwen3_path, monkeypatch):
    llm = _llm(qwen3_path)
    fused = llm.engine.runner.fused_decode
    assert fused is not None and fused.record.layers[0].q_norm
    rec = _Steps(llm, monkeypatch)
    prompts = [[3, 17, 99], list(range(20, 50))]
    fused_ids = _generate(llm, prompts, 24, fused=True)
    fused_logits = list(rec.logits)
    assert max(rec.fused_rows) == 2
    rec.logits.clear()
    assert _generate(llm, prompts, 24, fused=False) == fused_ids
    for a, b in zip(fused_logits, rec.logits, strict=True):
        assert torch.equal(a, b)  # no window: every step bit for bit


def test_the_avx2_build_gives_the_module_paths_tokens(gemma, monkeypatch):
    """decode_step.c built for x86-64-v3 (AVX2, strict fp32: vec_math.h's 8-lane GeGLU,
    norms and e^x) runs the tiny Gemma's steps past its window with the module path's
    greedy tokens."""
    from tests.model.conftest import load_for_march

    lib = load_for_march(decode_step._lib)
    assert lib.tm_decode_step_abi() == decode_step._lib.get("tm_decode_step_abi")()
    expected = _generate(gemma, [PROMPTS[2]], 24, fused=False)
    get = decode_step._lib.get
    monkeypatch.setattr(decode_step._lib, "get",
                        lambda name: getattr(lib, name) if name.startswith("tm_") else get(name))
    rec = _Steps(gemma, monkeypatch)
    assert _generate(gemma, [PROMPTS[2]], 24, fused=True) == expected
    assert rec.fused_rows == [1] * 23
