"""The whole engine on the triton backend under the interpreter: greedy tokens
identical to the torch backend's through a preemption and a prefix-cache hit, with
every other attention path patched to raise (no step falls back), and NaN in the
KV pool's unused memory; then a short run of the embedded model."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.conftest import assert_no_leak
from tokenmill import LLM, SamplingParams

# where CUDA is present the interpreter fixture skips every test here; skip before the
# module's model fixture runs (it needs the embedded GGUF, which a bare GPU box lacks)
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="CUDA is present: the kernels run compiled, on the GPU"),
              pytest.mark.usefixtures("interpreter", "no_overflow_checks")]


@pytest.fixture
def no_overflow_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter checks every int32 add and mul for overflow, a third of its time
    here; the kernel tests keep the checks, the engine runs without them."""
    from dataclasses import replace

    from triton.runtime.interpreter import interpreter_builder

    monkeypatch.setattr(interpreter_builder, "options",
                        replace(interpreter_builder.options, sanitize_overflow=False))


@pytest.fixture(scope="module")
def two_layer_model(tmp_path_factory) -> str:
    """The root tiny_model's recipe with 2 layers, not 4: the interpreter is slow."""
    from tests.speculative.conftest import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-2"), num_layers=2)


def forbid_other_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every entry point of the torch and cpu attention paths raises."""
    import tokenmill.models.attention as layer
    from tokenmill.attention import cpu, torch_ref

    def fallback(*args, **kwargs):
        raise AssertionError("a step left the triton backend")

    for cls in (torch_ref.TorchBackend, cpu.CpuBackend):
        for name in ("plan", "store_kv", "forward"):
            monkeypatch.setattr(cls, name, fallback)
    for module, name in [(torch_ref, "paged_attention_reference"), (torch_ref, "store_kv_torch"),
                         (cpu, "paged_attention_fast"), (layer, "causal_attention")]:
        monkeypatch.setattr(module, name, fallback)


def poison(llm: LLM) -> None:
    for k, v in llm.engine.runner.kv_caches:
        k.fill_(float("nan"))
        v.fill_(float("nan"))


def run_workload(llm: LLM) -> tuple[list[list[int]], int, list[int]]:
    """A prompt alone (its blocks go to the prefix cache), then six at once in a cache
    too small for all: two of them share the first prompt's 32-token prefix."""
    rng = random.Random(0)
    prefix = [rng.randrange(100, 49000) for _ in range(32)]
    first = prefix + [rng.randrange(100, 49000) for _ in range(5)]
    prompts = [prefix + [rng.randrange(100, 49000) for _ in range(n)] for n in (7, 3)]
    prompts += [[rng.randrange(100, 49000) for _ in range(n)] for n in (30, 18, 25, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([first], greedy, use_tqdm=False)
    outs += llm.generate(prompts, greedy, use_tqdm=False)
    assert_no_leak(llm.engine)
    return ([o.outputs[0].token_ids for o in outs], llm.engine.get_stats().num_preemptions,
            [o.num_cached_tokens for o in outs])


def test_engine_on_triton_matches_torch(two_layer_model, monkeypatch):
    engine_args = {"dtype": "float32", "num_kv_blocks": 12, "max_num_seqs": 6,
                   "max_num_batched_tokens": 64}
    expected = run_workload(LLM(two_layer_model, attention_backend="torch", **engine_args))
    _, preemptions, cached = expected
    assert preemptions >= 1 and max(cached[1:3]) >= 32  # the workload does what it says

    forbid_other_attention(monkeypatch)
    from tokenmill.attention.triton import backend as triton_backend

    def separate(*args, **kwargs):
        raise AssertionError("a step rotated and stored in two kernels, not rotary_store")

    monkeypatch.setattr(triton_backend.TritonBackend, "store_kv", separate)
    llm = LLM(two_layer_model, attention_backend="triton", **engine_args)
    assert llm.engine.runner.backend.name == "triton"
    assert llm.engine.runner.pool.fresh is None  # no zeroing: the kernels mask
    poison(llm)
    assert run_workload(llm) == expected


@pytest.mark.slow
def test_embedded_model_on_triton_matches_torch(monkeypatch):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def generate(backend: str) -> list[list[int]]:
        llm = LLM("smollm2-135m", dtype="float32", attention_backend=backend,
                  num_kv_blocks=16)
        if backend == "triton":
            poison(llm)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    expected = generate("torch")
    forbid_other_attention(monkeypatch)
    assert generate("triton") == expected
    assert all(len(t) == 8 for t in expected)
    assert torch.isfinite(torch.tensor(expected)).all()


def test_decode_linears_fused_with_their_norms_give_the_same_tokens(two_layer_model,
                                                                    monkeypatch):
    """triton_decode_linear (a CUDA decode batch's linears, each with the RMSNorm or
    SiLU * up before it) run here on CPU tensors under the interpreter: the same greedy
    tokens as the torch backend's separate ops, every decode step's linears on it."""
    engine_args = {"dtype": "float32", "num_kv_blocks": 12, "max_num_seqs": 6,
                   "max_num_batched_tokens": 64}
    expected = run_workload(LLM(two_layer_model, attention_backend="torch", **engine_args))

    from tokenmill.kernels import layer_ops, triton_decode_linear

    calls = {"linear": 0, "norm_linear": 0, "silu_mul_linear": 0}

    def counting(name):
        fn = getattr(triton_decode_linear, name)

        def counted(*args, **kwargs):
            if name == "linear" and args[1].shape[0] > 1024:  # the LM head: slow here
                return None
            out = fn(*args, **kwargs)
            calls[name] += out is not None
            return out
        return counted

    for name in calls:
        monkeypatch.setattr(triton_decode_linear, name, counting(name))
    monkeypatch.setattr(layer_ops, "decode_linears", lambda x: triton_decode_linear)
    llm = LLM(two_layer_model, attention_backend="triton", **engine_args)
    assert run_workload(llm) == expected
    steps = calls["silu_mul_linear"] // 2  # forward passes it took (2 layers)
    assert steps >= 12  # every decode step's: 12 tokens each, in batches of up to 6
    # a layer: qkv and gate_up with their norms, down with SiLU * up, o_proj plain
    assert calls["norm_linear"] == 2 * calls["silu_mul_linear"]
    assert calls["linear"] == calls["silu_mul_linear"]
