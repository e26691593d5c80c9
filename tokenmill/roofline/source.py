"""MODEL argument → architecture and default weight format: a preset name, a config.json,
an HF checkpoint directory, or a GGUF file (read through tokenmill's own loaders)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenmill.roofline.arch import (
    ModelArch,
    WeightBits,
    default_dtype,
    gguf_tensor_totals,
    gguf_weight_bits,
)
from tokenmill.roofline.presets import PRESETS, preset_config


class ModelNotFound(ValueError):
    pass


@dataclass(frozen=True)
class ResolvedModel:
    arch: ModelArch
    default_bits: WeightBits  # the checkpoint's own format (GGUF: measured from its tensors)
    gguf_path: str | None = None
    notes: tuple[str, ...] = ()


def resolve(spec: str) -> ResolvedModel:
    config = preset_config(spec)
    if config is not None:
        arch = ModelArch.from_config(config)
        return ResolvedModel(arch, WeightBits.from_name(default_dtype(arch)))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".json":
        return _from_config(_read_json(path), path.parent.name or path.stem)
    if path.is_dir() and (path / "config.json").is_file() and not any(path.glob("*.safetensors")):
        # a config-only directory: enough for roofline, though not for serving
        return _from_config(_read_json(path / "config.json"), path.name)
    if path.exists():
        return _from_loader(path)
    known = f"known presets: {', '.join(PRESETS)}"
    if "/" in spec or path.suffix.lower() in (".gguf", ".json"):
        raise ModelNotFound(f"model path {spec!r} does not exist ({known})")
    raise ModelNotFound(
        f"unknown model {spec!r}; known presets: {', '.join(PRESETS)}; or pass a config.json, "
        "an HF checkpoint directory or a .gguf file")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelNotFound(f"cannot read {path}: {e}") from None


def _from_config(config: dict, name: str) -> ResolvedModel:
    try:
        arch = ModelArch.from_config(config, name=name)
    except (TypeError, ValueError) as e:
        raise ModelNotFound(f"{name}: {e}") from None
    return ResolvedModel(arch, WeightBits.from_name(default_dtype(arch)))


def _from_loader(path: Path) -> ResolvedModel:
    # lazy: the loaders package imports torch
    from tokenmill.loaders.errors import ModelLoadError, ModelSourceError
    from tokenmill.loaders.model_source import hf_config_dict, resolve_model

    try:
        source = resolve_model(path)
        config = hf_config_dict(source)
    except (ModelSourceError, ModelLoadError) as e:
        raise ModelNotFound(str(e)) from None
    if source.kind != "gguf":
        return _from_config(config, source.name)
    from tokenmill.loaders.gguf import open_gguf  # cached: parsing the metadata takes seconds

    reader = open_gguf(source.path)
    _add_gguf_experts(config, reader)
    arch = ModelArch.from_config(config, name=source.name)
    bits = gguf_weight_bits(reader)
    return ResolvedModel(arch, bits, str(source.path), _check_gguf_params(arch, reader))


def _add_gguf_experts(config: dict, reader) -> None:
    """The loader's config carries no MoE fields; read them from the metadata."""
    arch = config.get("model_type")
    for gguf_key, hf_key in (("expert_count", "num_local_experts"),
                             ("expert_used_count", "num_experts_per_tok")):
        field = reader.fields.get(f"{arch}.{gguf_key}")
        if field is not None and config.get(hf_key) is None:
            config[hf_key] = int(field.contents())


def _check_gguf_params(arch: ModelArch, reader) -> tuple[str, ...]:
    n_params, _ = gguf_tensor_totals(reader)
    if n_params != arch.total_params():
        return ((f"the GGUF holds {n_params:,} parameters, the architecture counts "
                f"{arch.total_params():,}: byte counts follow the architecture"),)
    return ()
