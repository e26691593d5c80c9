"""Phi-3 / Phi-4-mini's config.json -> ModelConfig. Torch-free: the engine core and
roofline read configs too.

Phi-3 spells its RoPE scaling `rope_scaling` (released files; type "longrope", or
"su" in the oldest) or `rope_parameters` (transformers 5), with `short_factor` /
`long_factor` (one per rotary frequency) and `original_max_position_embeddings`
beside the top-level `max_position_embeddings`. Phi-4-mini rotates only the first
`partial_rotary_factor` of each head's dims. The 4k releases set `sliding_window`
(2047); a Phi-3 config has no `use_sliding_window` switch: set means on.
"""

from __future__ import annotations

from typing import Any

_ROPE_TYPES = ("default", "longrope")


def _rope(cfg: dict[str, Any], rotary_dim: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the normalised longrope dict or None)."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10_000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type in ("su", "yarn"):  # older names transformers' Phi3Config reads as longrope
        rope_type = "longrope"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported for Phi-3; "
                         f"tokenmill runs {', '.join(_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    original = params.get("original_max_position_embeddings") or \
        cfg.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_scaling longrope needs original_max_position_embeddings")
    scaling: dict[str, Any] = {"rope_type": "longrope",
                               "original_max_position_embeddings": int(original),
                               "factor": params.get("factor"),
                               "attention_factor": params.get("attention_factor")}
    for key in ("short_factor", "long_factor"):
        factors = params.get(key)
        if not isinstance(factors, list) or len(factors) != rotary_dim // 2:
            raise ValueError(f"rope_scaling {key} must be a list of {rotary_dim // 2} numbers "
                             f"(one per rotary frequency), got {factors!r}")
        scaling[key] = [float(f) for f in factors]
    return theta, scaling


def phi3_config(cls: type, cfg: dict[str, Any]) -> Any:
    """A ModelConfig (cls) of a Phi3ForCausalLM config dict."""
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias is set; Phi-3 has no biases and "
                         "tokenmill's Phi-3 loads none")
    hidden = int(cfg["hidden_size"])
    n_heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    params = cfg.get("rope_parameters") or {}
    partial = float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor")
                    or 1.0)
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"partial_rotary_factor {partial} gives {rotary_dim} rotary dims of "
                         f"head_dim {head_dim}; it must be even and between 2 and head_dim")
    theta, scaling = _rope(cfg, rotary_dim)
    window = cfg.get("sliding_window")
    return cls(
        architecture="Phi3ForCausalLM",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=n_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=cfg.get("hidden_act", "silu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        sliding_window=int(window) if window else None,
        partial_rotary_factor=partial,
    )
