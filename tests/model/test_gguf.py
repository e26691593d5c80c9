"""Tiny GGUF files written like llama.cpp's converter: tokenmill reads them as transformers does,
keeps the raw quantized blocks in Hugging Face row order, and names bad files clearly."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch

from tests.model.conftest import make_hf_model, write_tiny_gguf
from tokenmill.loaders import ModelLoadError, hf_config_dict, load_model, resolve_model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    def make(arch: str, **overrides):
        model = make_hf_model(arch, **overrides)
        path = tmp_path_factory.mktemp(f"gguf-{arch}") / "tiny.gguf"
        return write_tiny_gguf(model, path, arch=arch)
    return make


@pytest.mark.parametrize(("arch", "overrides"), [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("qwen2", {}),
    # transformers' GGUF loader ignores qwen3.attention.key_length and assumes head_dim 128
    ("qwen3", {"head_dim": 128}),
], ids=["llama-permuted-qk", "llama-tied", "qwen2-bias", "qwen3"])
def test_gguf_logits_match_transformers_gguf_loader(tiny_gguf, arch, overrides):
    import transformers

    path = tiny_gguf(arch, **overrides)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    loaded = load_model(path)
    assert loaded.dtype == torch.float32
    assert loaded.config.tie_word_embeddings == bool(overrides.get("tie_word_embeddings"))
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        got = loaded.model.compute_logits(loaded.model(ids, torch.arange(24)))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_raw_blocks_are_kept_in_hf_row_order(tiny_gguf):
    loaded = load_model(tiny_gguf("llama"))
    attn = loaded.model.model.layers[0].self_attn
    shards = attn.qkv_proj.gguf_quantized
    Q = gguf.GGMLQuantizationType
    assert [(s.qtype, s.row_offset, s.shape) for s in shards] == [
        (Q.Q4_1, 0, (64, 64)), (Q.Q4_1, 64, (32, 64)), (Q.Q8_0, 96, (32, 64))]
    for linear in (attn.qkv_proj, attn.o_proj, loaded.model.model.layers[1].mlp.gate_up_proj):
        for s in linear.gguf_quantized:
            assert s.blocks.dtype == torch.uint8
            rows = gguf.quants.dequantize(s.blocks.numpy(), s.qtype).reshape(s.shape)
            weight_rows = linear.weight[s.row_offset:s.row_offset + s.shape[0]]
            assert torch.equal(torch.from_numpy(rows), weight_rows)
    assert loaded.model.model.embed_tokens.gguf_quantized[0].qtype == Q.Q8_0
    assert not hasattr(loaded.model.model.norm, "gguf_quantized")  # F32: nothing to keep


def test_config_from_gguf_metadata(tiny_gguf):
    cfg = hf_config_dict(resolve_model(str(tiny_gguf("qwen3", head_dim=32))))
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 32)
    assert cfg["vocab_size"] == 256 and cfg["tie_word_embeddings"] is False
    assert cfg["quantization_config"]["tensor_types"]["Q4_1"] > 0


def test_truncated_gguf_is_a_clear_error(tiny_gguf, tmp_path):
    data = tiny_gguf("llama").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*truncated"):
        load_model(cut)


def test_embedded_gguf_cut_to_a_few_kb_is_a_clear_error(tmp_path):
    src = resolve_model("smollm2-135m").path
    cut = tmp_path / "smollm2-cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(4096))
    with pytest.raises(ModelLoadError, match=r"smollm2-cut\.gguf.*(corrupt|truncated)"):
        load_model(cut)


def test_garbage_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(np.random.default_rng(0).bytes(10_000))
    with pytest.raises(ModelLoadError, match=r"garbage\.gguf.*corrupt"):
        load_model(bad)


def test_unsupported_gguf_architecture(tiny_gguf, tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"gpt2\.gguf.*architecture 'gpt2'"):
        load_model(tmp_path / "gpt2.gguf")


def test_copied_gguf_loads_from_its_own_path(tiny_gguf, tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copy(tiny_gguf("llama"), copy)
    assert load_model(str(copy)).source.name == "copy"
