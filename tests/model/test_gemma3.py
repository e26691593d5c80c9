"""Tiny random Gemma 3 checkpoints written here: tokenmill's logits and greedy tokens
match transformers' (fp32), across a sliding window of 8 with prompts longer than it,
in the torch and cpu backends (triton: tests/attention/test_gemma3_triton_engine.py),
through preemption and a prefix-cache hit."""

from __future__ import annotations

import pytest
import torch

from tokenmill.loaders import load_model

WINDOW = 8
# layers 0, 1 and 3 local (window 8, RoPE base 10k), layer 2 global (1M, linear x8)
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _text_config(vocab_size: int):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        sliding_window=WINDOW, layer_types=LAYER_TYPES, query_pre_attn_scalar=24,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


def _randomize(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.15 if "norm" in name else 0.1)
            if "embed_tokens" in name:
                p.mul_(4.0)  # peaked next-token distributions: greedy ties are unlikely


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """A 4-layer Gemma3ForCausalLM with SmolLM2's tokenizer and vocabulary."""
    from transformers import Gemma3ForCausalLM

    from tokenmill.loaders import load_tokenizer, resolve_model

    model = Gemma3ForCausalLM(_text_config(49152)).eval()
    _randomize(model)
    path = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(path)
    load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(path)
    return str(path), model


def _hf_logits(hf_model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids[None]).logits[0]


def test_logits_match_transformers_past_the_window(gemma_dir):
    path, hf_model = gemma_dir
    loaded = load_model(path, dtype="float32")
    cfg = loaded.config
    assert cfg.layer_types == LAYER_TYPES and cfg.sliding_window == WINDOW
    assert [a.sliding_window for a in loaded.model.attention_layers()] == [8, 8, None, 8]
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(1))
    expected = _hf_logits(hf_model, ids)
    with torch.no_grad():
        got = loaded.model.compute_logits(loaded.model(ids, torch.arange(40)))
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)


def test_the_window_changes_the_logits(gemma_dir):
    """The comparison above can fail: without the mask the logits past W differ."""
    path, hf_model = gemma_dir
    loaded = load_model(path, dtype="float32")
    for attn in loaded.model.attention_layers():
        attn.sliding_window = None
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = loaded.model.compute_logits(loaded.model(ids, torch.arange(40)))
    expected = _hf_logits(hf_model, ids)
    torch.testing.assert_close(got[:WINDOW], expected[:WINDOW], atol=2e-4, rtol=0)
    assert (got[WINDOW + 1:] - expected[WINDOW + 1:]).abs().max() > 1e-2


def _prompts() -> list[list[int]]:
    """Five prompts longer than the window; three share a 24-token prefix (prefix-cache
    hits once the first has run)."""
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 49000, (24,), generator=g).tolist()
    own = [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (5, 11, 19, 13, 30)]
    return [system + own[i] if i < 3 else own[i] for i in range(5)]


def _hf_greedy(hf_model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(_hf_logits(hf_model, torch.tensor(ids))[-1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def hf_greedy(gemma_dir) -> dict[int, list[list[int]]]:
    """transformers' greedy tokens per step count, computed once per module."""
    cache: dict[int, list[list[int]]] = {}

    def get(steps: int) -> list[list[int]]:
        if steps not in cache:
            cache[steps] = [_hf_greedy(gemma_dir[1], p, steps) for p in _prompts()]
        return cache[steps]

    return get


def _engine_greedy(path: str, backend: str, steps: int, num_kv_blocks: int = 10
                   ) -> tuple[list[list[int]], object]:
    from tokenmill import LLM, SamplingParams

    # 10 blocks of 8 tokens for five sequences of up to 55 tokens: they preempt; 24
    # tokens a step: prompts are chunked and share steps with decodes
    llm = LLM(path, dtype="float32", attention_backend=backend, num_kv_blocks=num_kv_blocks,
              block_size=8, max_num_seqs=5, max_num_batched_tokens=24)
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.0),
                        use_tqdm=False)
    stats = llm.engine.get_stats()
    llm.engine.check_kv_integrity()
    return [list(o.outputs[0].token_ids) for o in outs], stats


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_tokens_match_transformers_through_preemption_and_prefix_hits(
        gemma_dir, hf_greedy, backend):
    path, _ = gemma_dir
    steps = 12
    got, stats = _engine_greedy(path, backend, steps)
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits >= 2 * 8
    assert got == hf_greedy(steps)


def test_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint: the text decoder runs, the vision
    tower is skipped."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=_text_config(256).to_dict(),
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4, image_token_index=255, boi_token_index=253,
        eoi_token_index=254)
    hf_model = Gemma3ForConditionalGeneration(config).eval()
    _randomize(hf_model)
    hf_model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    assert loaded.config.architecture == "Gemma3ForCausalLM"
    ids = torch.randint(0, 250, (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(input_ids=ids[None]).logits[0]
        got = loaded.model.compute_logits(loaded.model(ids, torch.arange(20)))
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)
