"""Tiny random Phi-3 checkpoints written here with transformers: tokenmill's logits and
32 greedy tokens match transformers' (fp32) in the torch and cpu backends, for LongRoPE
across original_max_position_embeddings, Phi-4-mini's partial rotary (0.75) and a
sliding window shorter than the prompt; config fields tokenmill does not run are
refused by name."""

from __future__ import annotations

import functools

import pytest
import torch

from tokenmill.config import ModelConfig
from tokenmill.loaders import load_model

VOCAB = 49152  # SmolLM2's tokenizer, saved beside the weights
ORIGINAL = 32  # original_max_position_embeddings of the LongRoPE checkpoints
WINDOW = 8


def _factors(n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 3.0 * torch.rand(n, generator=g)).tolist()


def _config(kind: str):
    from transformers import Phi3Config

    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if kind == "longrope":  # Phi-3-mini-128k's shape of config
        return Phi3Config(**common, max_position_embeddings=256,
                          original_max_position_embeddings=ORIGINAL,
                          rope_scaling={"type": "longrope", "short_factor": _factors(8, 1),
                                        "long_factor": _factors(8, 2)})
    if kind == "partial":  # Phi-4-mini's: 12 of 16 head dims rotate, longrope, tied head
        return Phi3Config(**common, max_position_embeddings=256,
                          original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,
                          tie_word_embeddings=True,
                          rope_scaling={"type": "longrope", "short_factor": _factors(6, 3),
                                        "long_factor": _factors(6, 4)})
    return Phi3Config(**common, max_position_embeddings=256, sliding_window=WINDOW)


@functools.cache
def _tokenizer():
    from tokenmill.loaders import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("smollm2-135m"))


def _write(kind: str, root, tokenizer: bool = True) -> tuple[str, torch.nn.Module]:
    from transformers import Phi3ForCausalLM

    torch.manual_seed(0)
    model = Phi3ForCausalLM(_config(kind)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.15 if "norm" in name else 0.1)
            if "norm" in name:
                p.add_(1.0)
            if "embed_tokens" in name:
                p.mul_(4.0)  # peaked next-token distributions: greedy ties are unlikely
    path = root / kind
    model.save_pretrained(path)
    if tokenizer:
        _tokenizer().save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module", params=["longrope", "partial", "window"])
def phi3(request, tmp_path_factory) -> tuple[str, str, torch.nn.Module]:
    return (request.param, *_write(request.param, tmp_path_factory.mktemp("phi3")))


def _prompts() -> list[list[int]]:
    """Past the original context / the window from the prompt on (40), and a prompt of
    20 whose 32 new tokens cross the original context while decoding."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (40, 20, 45)]


def _hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy decode with its KV cache (each forward picks its LongRoPE
    factors by its largest position, as generate does)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        ids = []
        for _ in range(steps):
            ids.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[ids[-1]]]), cache=out.past_key_values, use_cache=True)
    return ids


def test_config_reads_the_phi3_fields(phi3):
    kind, path, _ = phi3
    cfg = load_model(path, dtype="float32").config
    assert cfg.architecture == "Phi3ForCausalLM"
    if kind == "window":
        assert cfg.sliding_window == WINDOW and cfg.rope_scaling is None
    else:
        assert cfg.rope_scaling["original_max_position_embeddings"] == ORIGINAL
        assert cfg.partial_rotary_factor == (0.75 if kind == "partial" else 1.0)


def test_prompt_logits_match_transformers(phi3):
    kind, path, hf_model = phi3
    loaded = load_model(path, dtype="float32")
    ids = torch.tensor(_prompts()[0])  # 40 tokens: past ORIGINAL and WINDOW
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
        got = loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids))))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    if kind == "longrope":  # the long factors matter: the short ones give other logits
        rotary = loaded.model.model.rotary_emb
        rotary.original = 10_000
        rotary.cos_cache, rotary.sin_cache = rotary.cos_cache[:10_000], rotary.sin_cache[:10_000]
    elif kind == "window":
        for attn in loaded.model.attention_layers():
            attn.sliding_window = None
    else:
        rotary = loaded.model.model.rotary_emb
        rotary.rotary_dim = 16  # rotate every dim: other logits
        return
    with torch.no_grad():
        wrong = loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids))))
    assert (wrong - expected).abs().max() > 1e-2


_HF_GREEDY: dict[str, list[list[int]]] = {}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_tokens_match_transformers(phi3, backend):
    from tokenmill import LLM, SamplingParams

    kind, path, hf_model = phi3
    steps = 32
    if kind not in _HF_GREEDY:  # once per checkpoint, for both backends
        _HF_GREEDY[kind] = [_hf_greedy(hf_model, p, steps) for p in _prompts()]
    expected = _HF_GREEDY[kind]
    # every prompt in one step (a chunked LongRoPE prompt rotates its first chunks short:
    # models/phi3.py); 8-token blocks, so windows cross block edges
    llm = LLM(path, dtype="float32", attention_backend=backend, block_size=8,
              max_num_batched_tokens=256, max_num_seqs=3)
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=steps, ignore_eos=True,
                                                   temperature=0.0), use_tqdm=False)
    llm.engine.check_kv_integrity()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def _hf_dict(**over) -> dict:
    base = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 100,
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 256}
    return {**base, **over}


@pytest.mark.parametrize("over, field", [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                       "long_factor": [1.0] * 8}}, "original_max_position_embeddings"),
    ({"original_max_position_embeddings": 32,
      "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 7,
                       "long_factor": [1.0] * 8}}, "short_factor"),
    ({"attention_bias": True}, "attention_bias"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_config_fields_are_refused_by_name(over, field):
    from tokenmill.models.phi3 import Phi3ForCausalLM

    with pytest.raises(ValueError, match=field):
        Phi3ForCausalLM(ModelConfig.from_hf_dict(_hf_dict(**over)))


def test_a_fused_tensor_of_the_wrong_size_names_it(tmp_path):
    path, _ = _write("window", tmp_path, tokenizer=False)
    from safetensors.torch import load_file, save_file

    file = next(p for p in (tmp_path / "window").iterdir() if p.suffix == ".safetensors")
    tensors = load_file(file)
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(Exception, match="qkv_proj"):
        load_model(path, dtype="float32")


def test_a_gguf_phi3_file_is_refused_by_name(tmp_path):
    import gguf

    from tokenmill.loaders.errors import ModelLoadError

    path = tmp_path / "phi3.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="'phi3'.*Hugging Face checkpoints only"):
        load_model(str(path))


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_bf16_rotation_matches_fp32_with_long_factors(partial):
    """bf16 on the CPU takes the fused native rotary (full width) at the long table's rows;
    it agrees with the fp32 rotation to bf16 rounding, and the long rows differ from
    the short ones."""
    from tokenmill.models.phi3 import Phi3RotaryEmbedding

    rot = int(16 * partial)
    cfg = ModelConfig.from_hf_dict(_hf_dict(
        original_max_position_embeddings=ORIGINAL, partial_rotary_factor=partial,
        rope_scaling={"type": "longrope", "short_factor": _factors(rot // 2, 1),
                      "long_factor": _factors(rot // 2, 2)}))
    rotary = Phi3RotaryEmbedding(cfg)
    x = torch.randn(40, 6, 16, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40)
    want = rotary.rotate(positions, x.clone())
    got = rotary.rotate(positions, x.to(torch.bfloat16).clone()).float()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
    short = rotary.rotate(positions[:20], x[:20].clone())  # length 20 <= ORIGINAL: short
    assert (short - want[:20]).abs().max() > 1e-2
