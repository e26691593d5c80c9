"""The Mixture-of-Experts part of a GGUF file's config, checked against its tensors.

llama.cpp stores an MoE layer as a router `blk.N.ffn_gate_inp` (E, hidden) and the
experts stacked, one tensor per projection: `ffn_gate_exps` / `ffn_up_exps`
(E, I, hidden) and `ffn_down_exps` (E, hidden, I) (Hugging Face order; ggml's
shape is reversed). Qwen3-MoE is architecture `qwen3moe`; Mixtral is `llama` with
`llama.expert_count`. Files converted before llama.cpp stacked the experts (early
2024) hold one tensor per expert (`blk.N.ffn_gate.E.weight`): those are refused by
name, as current llama.cpp refuses them too.

Every count and shape is checked here, before a weight is read: an expert count,
top-k or stacked shape that disagrees is a load error naming the key or tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.loaders.errors import ModelLoadError

MOE_BLOCK_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_PER_EXPERT = re.compile(r"blk\.\d+\.ffn_(?:gate|up|down)\.\d+\.weight")


def refuse_per_expert_layout(names: list[str], path: Path) -> None:
    old = next((n for n in names if _PER_EXPERT.fullmatch(n)), None)
    if old is not None:
        raise ModelLoadError(
            f"GGUF file {path} stores each expert as its own tensor ({old}), the layout of "
            "Mixtral files converted before llama.cpp stacked experts (ffn_gate_exps); "
            "tokenmill reads stacked experts only: re-convert the model with a current "
            "llama.cpp convert_hf_to_gguf.py")


def moe_config(get: Callable[..., Any], arch: str, shapes: dict[str, tuple[int, ...]],
               hidden: int, layers: int, path: Path) -> dict[str, Any]:
    """Config keys for an MoE file ({} for a dense one). `get(key)` reads `{arch}.key`;
    `shapes` maps tensor names to their Hugging Face-order shapes."""
    refuse_per_expert_layout(list(shapes), path)
    experts = get("expert_count")
    if arch != "qwen3moe" and not experts:
        return {}
    where = f"GGUF file {path}"
    if not experts or int(experts) < 1:
        raise ModelLoadError(f"{where}: {arch}.expert_count is {experts!r}; an MoE model "
                             "needs at least one expert")
    experts = int(experts)
    top_k = int(get("expert_used_count", 0) or 0)
    if not 1 <= top_k <= experts:
        raise ModelLoadError(f"{where}: {arch}.expert_used_count ({top_k}) must be between 1 "
                             f"and {arch}.expert_count ({experts})")
    inter_key = "expert_feed_forward_length" if arch == "qwen3moe" else "feed_forward_length"
    inter = get(inter_key)
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in shapes]
    if not sparse:
        raise ModelLoadError(f"{where}: {arch}.expert_count is {experts} but no layer has "
                             "stacked experts (blk.N.ffn_gate_exps.weight)")
    if inter is None:
        inter = shapes[f"blk.{sparse[0]}.ffn_gate_exps.weight"][1]
    inter = int(inter)
    expected = {"ffn_gate_inp": (experts, hidden), "ffn_gate_exps": (experts, inter, hidden),
                "ffn_up_exps": (experts, inter, hidden), "ffn_down_exps": (experts, hidden, inter)}
    for i in sparse:
        for kind, shape in expected.items():
            name = f"blk.{i}.{kind}.weight"
            if name not in shapes:
                raise ModelLoadError(f"{where}: layer {i} has stacked experts but no {name}")
            if shapes[name] != shape:
                raise ModelLoadError(
                    f"{where}: tensor {name} has shape {shapes[name]} (Hugging Face order), "
                    f"but {arch}.expert_count {experts}, {arch}.{inter_key} {inter} and "
                    f"embedding_length {hidden} make it {shape}")
    dense = [i for i in range(layers) if i not in sparse]
    if arch != "qwen3moe" and dense:
        raise ModelLoadError(f"{where}: layer {dense[0]} has no stacked experts "
                             f"(blk.{dense[0]}.ffn_gate_exps.weight); Mixtral's every layer has")
    norm = get("expert_weights_norm")
    return {
        "architectures": ["Qwen3MoeForCausalLM" if arch == "qwen3moe" else "MixtralForCausalLM"],
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": inter,
        # llama.cpp renormalizes the top-k weights of both families unless the file says not
        "norm_topk_prob": True if norm is None else bool(norm),
        "mlp_only_layers": dense,
    }
