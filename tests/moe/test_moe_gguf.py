"""Qwen3-MoE (`qwen3moe`) and Mixtral (`llama` + expert_count) GGUF files with stacked
experts, written by the tests, against transformers holding the file's dequantized
weights; and malformed MoE files refused with the tensor or key named."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.moe.test_moe_hf import _engine_prompts, _hf_greedy, run_engine_greedy
from tokenmill.loaders import ModelLoadError, load_model
from tokenmill.loaders.gguf import open_gguf
from tokenmill.models.moe import MoeForCausalLM


def _logits(loaded, ids):
    with torch.no_grad():
        return loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids))))


@pytest.mark.parametrize("which", ["qwen3moe_q8", "mixtral_kquant"])
def test_gguf_logits_match_transformers(which, request):
    path, hf_model = request.getfixturevalue(which)
    loaded = load_model(path, dtype="float32")
    assert isinstance(loaded.model, MoeForCausalLM)
    expected_arch = "MixtralForCausalLM" if "mixtral" in which else "Qwen3MoeForCausalLM"
    assert loaded.config.architecture == expected_arch and loaded.config.num_experts == 8
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(_logits(loaded, ids), expected, atol=2e-4, rtol=0)


def test_gguf_engine_greedy_matches_transformers(mixtral_kquant):
    path, hf_model = mixtral_kquant
    prompts = _engine_prompts()
    got, _ = run_engine_greedy(str(path), prompts)
    assert got == [_hf_greedy(hf_model, p) for p in prompts]


# --- malformed files ---------------------------------------------------------------------

def _rewrite(src, dst, drop=(), replace=None, kv=None, extra=None):
    """Copy GGUF `src` to `dst` without its tokenizer, dropping tensors, replacing some
    (name -> array), adding `extra` ones and overriding integer metadata (key -> value)."""
    r = open_gguf(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, (kv or {}).get(key, field.contents()), vtype, sub_type=sub)
    for t in r.tensors:
        if t.name in drop:
            continue
        data = (replace or {}).get(t.name)
        if data is not None:
            w.add_tensor(t.name, data)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_malformed_moe_files_are_refused_naming_the_tensor(qwen3moe_q8, tmp_path):
    path, _ = qwen3moe_q8
    bad = _rewrite(path, tmp_path / "topk.gguf", kv={"qwen3moe.expert_used_count": 9})
    with pytest.raises(ModelLoadError, match=r"qwen3moe.expert_used_count \(9\)"):
        load_model(bad)
    bad = _rewrite(path, tmp_path / "count.gguf", kv={"qwen3moe.expert_count": 4})
    with pytest.raises(ModelLoadError, match=r"tensor blk.1.ffn_gate_inp.weight has shape"):
        load_model(bad)
    wrong = np.zeros((8, 64, 16), np.float32)  # (E, I, H) in ggml order: I != 32
    bad = _rewrite(path, tmp_path / "shape.gguf",
                   replace={"blk.1.ffn_up_exps.weight": wrong})
    with pytest.raises(ModelLoadError, match=r"tensor blk.1.ffn_up_exps.weight has shape"):
        load_model(bad)
    bad = _rewrite(path, tmp_path / "missing.gguf", drop={"blk.1.ffn_down_exps.weight"})
    with pytest.raises(ModelLoadError, match=r"no blk.1.ffn_down_exps.weight"):
        load_model(bad)


def test_per_expert_mixtral_gguf_is_refused_by_name(mixtral_kquant, tmp_path):
    path, _ = mixtral_kquant
    old = {f"blk.0.ffn_gate.{e}.weight": np.zeros((256, 256), np.float32) for e in range(8)}
    bad = _rewrite(path, tmp_path / "old.gguf", drop={"blk.0.ffn_gate_exps.weight"}, extra=old)
    with pytest.raises(ModelLoadError, match=r"blk.0.ffn_gate.0.weight.*re-convert"):
        load_model(bad)
