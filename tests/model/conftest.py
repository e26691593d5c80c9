"""Tiny random-weight checkpoints written by the tests themselves (HF safetensors and GGUF)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0}

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def make_hf_model(arch: str, **overrides: Any) -> torch.nn.Module:
    """A tiny transformers model with every weight random (norms and biases too)."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM,
                 "mistral": transformers.MistralForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}[arch]
    config = config_cls(**{**TINY, "tie_word_embeddings": False, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.15)
            if "norm" in name:
                p.add_(1.0)
    return model


def save_hf(model: torch.nn.Module, path: Path, **kwargs: Any) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """Factory: (arch, **config overrides, save_kwargs=...) -> (checkpoint dir, HF model)."""

    def make(arch: str, save_kwargs: dict[str, Any] | None = None, **overrides: Any):
        model = make_hf_model(arch, **overrides)
        path = tmp_path_factory.mktemp(f"hf-{arch}")
        return save_hf(model, path, **(save_kwargs or {})), model

    return make


# --- GGUF writing, the way llama.cpp's convert_hf_to_gguf does it ---------------------------

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    module, _, kind = hf_name.rpartition(".")
    if module.startswith("model.layers."):
        _, _, idx, rest = module.split(".", 3)
        return f"blk.{idx}.{_GGUF_NAMES[rest]}.{kind}"
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
            "lm_head": "output"}[module] + f".{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(model: torch.nn.Module, path: Path, arch: str = "llama",
                    q8_0: tuple[str, ...] = ("embed_tokens", "v_proj", "down_proj")) -> Path:
    """Write an HF model as GGUF: the tensors named in `q8_0` Q8_0 (by default embeddings,
    v and down), the other linears Q4_1, norms F32."""
    import gguf

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    Q = gguf.GGMLQuantizationType
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        if data.ndim == 1:
            qtype = Q.F32
        elif any(part in name for part in q8_0):
            qtype = Q.Q8_0
        else:
            qtype = Q.Q4_1
        w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_for_march(library: Any, march: str = "x86-64-v3") -> Any:
    """`library`'s kernel (a tokenmill.kernels.build.Library) built by build_for_march
    for -march=`march`, loaded, its functions bound with the library's signatures.
    Skips the test where this CPU cannot run an x86-64-v3 build."""
    import ctypes

    from tokenmill.cpuinfo import cpu_flags
    from tokenmill.kernels import build

    if march == "x86-64-v3" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    path = build_for_march(Path(build.__file__).with_name(f"{library.name}.c"), march)
    assert path is not None
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in library.signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def build_for_march(source: Path, march: str) -> Path | None:
    """Kernel source `source` built as a CPU without AVX-512 builds it (build.py's strict
    fp32 flags) for -march=`march`: the shared object, or None where it did not build.
    Skips the test where there is no C compiler."""
    from tokenmill.kernels import build

    compiler = build.compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    strict, link = build.FLAG_SETS[1]
    return build._build(compiler, source, (
        [f"-march={march}" if f.startswith("-march=") else f for f in strict], link))
