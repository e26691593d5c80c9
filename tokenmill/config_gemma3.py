"""Gemma 3's config.json (and the dict the GGUF loader builds from a `gemma3` file) ->
ModelConfig. Torch-free: the engine core and roofline read configs too.

Gemma 3 checkpoints spell the same things several ways: `rope_theta` +
`rope_local_base_freq` + `rope_scaling` (the released config.json files),
`rope_parameters` per layer type (transformers 5), `layer_types` or only
`sliding_window_pattern` (every Nth layer global), `hidden_activation` or
`hidden_act`. A Gemma3ForConditionalGeneration checkpoint keeps its language
model's config under `text_config`; only the text part runs here.
"""

from __future__ import annotations

from typing import Any


def _layer_types(cfg: dict[str, Any], num_layers: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        bad = sorted(set(types) - {"sliding_attention", "full_attention"})
        if bad:
            raise ValueError(f"layer_types: unknown layer type(s) {', '.join(bad)}")
        return list(types)
    pattern = int(cfg.get("sliding_window_pattern") or 6)  # Gemma 3: 5 local, 1 global
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)]


def _rope(cfg: dict[str, Any]) -> tuple[float, float, dict[str, Any] | None]:
    """(global base, local base, the global layers' scaling or None)."""
    params = cfg.get("rope_parameters") or {}
    full = params.get("full_attention") or {}
    local = params.get("sliding_attention") or {}
    global_theta = float(full.get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0)
    local_theta = float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0)
    scaling = cfg.get("rope_scaling")
    if not scaling and full.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling on the sliding layers ({local['rope_type']!r}) is not "
                         "supported; Gemma 3 scales only its global layers")
    return global_theta, local_theta, scaling or None


def gemma3_config(cls: type, cfg: dict[str, Any]) -> Any:
    """A ModelConfig (cls) of the text decoder of a Gemma 3 config dict."""
    text = dict(cfg.get("text_config") or cfg)
    for key in ("bos_token_id", "eos_token_id"):  # set on the outer config of a VLM
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    if text.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is set; Gemma 3 has none and tokenmill's "
                         "attention backends do not cap scores")
    if text.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (EmbeddingGemma) is not a causal "
                         "language model; tokenmill runs causal decoders")
    num_layers = int(text["num_hidden_layers"])
    hidden = int(text["hidden_size"])
    n_heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or 256)
    global_theta, local_theta, scaling = _rope(text)
    act = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
    return cls(
        architecture="Gemma3ForCausalLM",
        vocab_size=int(text.get("vocab_size", 262_208)),
        hidden_size=hidden,
        intermediate_size=int(text["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=global_theta,
        rope_scaling=scaling,
        max_position_embeddings=int(text.get("max_position_embeddings", 131_072)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings",
                                         text.get("tie_word_embeddings", True))),
        qk_norm=True,
        hidden_act=act,
        bos_token_id=text.get("bos_token_id", 2),
        eos_token_id=text.get("eos_token_id", 1),
        sliding_window=int(text.get("sliding_window") or 4096),
        layer_types=_layer_types(text, num_layers),
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(text.get("query_pre_attn_scalar") or head_dim),
        final_logit_softcapping=text.get("final_logit_softcapping"),
    )
