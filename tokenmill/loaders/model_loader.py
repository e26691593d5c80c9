"""Load a model: resolve the source, build the module without random init, fill it.

The weight loader is generic: checkpoint tensors arrive under Hugging Face
names; `packed_modules_mapping` routes q/k/v and gate/up into fused parameters,
and each parameter's own `weight_loader` copies the tensor into place. Tensors
arrive unread; under tensor parallelism a module's `checkpoint_slice` names
the slice this rank holds, and only that slice is read.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.loaders.errors import ModelLoadError
from tokenmill.loaders.model_source import (
    ModelSource,
    hf_config_dict,
    load_model_config,
    resolve_model,
)
from tokenmill.models.deferred_weights import defer

LOAD_FORMATS = ("auto", "dummy")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


@dataclass
class LoadedModel:
    model: nn.Module  # eval mode, on device, no grads; see models/llama.py for the interface
    config: ModelConfig
    dtype: torch.dtype
    source: ModelSource


def resolve_dtype(dtype: str | torch.dtype, source: ModelSource,
                  device: str | torch.device = "cpu") -> torch.dtype:
    """vLLM's names. auto: float32 for GGUF; the checkpoint's dtype for HF
    (float16 becomes bfloat16 on CPU, where float16 matmuls are slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
        return _DTYPES[dtype]
    if source.kind == "gguf":
        return torch.float32
    name = hf_config_dict(source).get("torch_dtype") or "float32"
    chosen = _DTYPES.get(str(name).removeprefix("torch."), torch.float32)
    if chosen == torch.float16 and torch.device(device).type == "cpu":
        return torch.bfloat16
    return chosen


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def load_model(source: ModelSource | str | Path, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu", load_format: str = "auto",
               defer_quantized: bool = False) -> LoadedModel:
    """load_format "dummy" (vLLM's name): the checkpoint's config, random weights made
    on the device; what a speed check at real shapes needs (benchmarks/gpu_check.py)
    without shipping or reading 16 GB of weights. defer_quantized: a GGUF linear's
    quantized weight is not dequantized into its float parameter until something
    calls `models.deferred_weights.materialize` on it (the engine's path: most such
    linears run on their blocks and never need the float values)."""
    from tokenmill.models.registry import get_model_class

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; use {' or '.join(LOAD_FORMATS)}")

    if not isinstance(source, ModelSource):
        source = resolve_model(source)
    config = load_model_config(source)
    torch_dtype = resolve_dtype(dtype, source, device)
    with _default_dtype(torch_dtype), torch.device(device):
        model = get_model_class(config.architecture)(config)  # type: ignore[call-arg]
    if load_format == "dummy":
        fill_dummy_weights(model)
    elif source.kind == "gguf":
        from tokenmill.loaders.gguf import gguf_errors, iter_gguf_tensors

        with gguf_errors(source.path, "load the weights of"), _naming(source.path):
            load_weights(model, iter_gguf_tensors(source.path), defer_quantized)
    else:
        from tokenmill.loaders.safetensors import iter_safetensors

        with _naming(source.path):
            load_weights(model, iter_safetensors(source.path))
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model, config, torch_dtype, source)


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """A load error names the file it came from (a user may hold several)."""
    try:
        yield
    except ModelLoadError as e:
        if str(path) in str(e):
            raise
        raise ModelLoadError(f"{path}: {e}") from None


def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Every parameter uniform in [-1e-2, 1e-2) (norm weights near 1), drawn on its
    own device: small enough that activations stay finite at any depth."""
    gen = None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if gen is None or gen.device != param.device:
                gen = torch.Generator(param.device).manual_seed(seed)
            param.uniform_(-1e-2, 1e-2, generator=gen)
            if "norm" in name:
                param.add_(1.0)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, Any] | Any],
                 defer_quantized: bool = False) -> None:
    """Copy checkpoint tensors into the model's parameters.

    `weights` yields (hf_name, tensor) pairs or GGUFTensor objects. A GGUF tensor
    is dequantized one at a time; if it was quantized, its raw blocks are kept on
    the owning module as `module.gguf_quantized: list[QuantizedWeight]`. With
    `defer_quantized`, such a 2-d weight is not dequantized now: its parameter is
    deferred (models/deferred_weights.py) and filled only if someone asks.
    """
    from tokenmill.loaders.gguf import GGUFTensor, QuantizedWeight

    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    loaded: dict[str, set[Any]] = {}
    # a model whose checkpoints nest it (Gemma 3's multimodal one) renames or skips tensors
    rename = getattr(model, "checkpoint_name", None)
    remap = getattr(model, "checkpoint_param", None)  # an MoE's stacked experts (models/moe.py)
    for item in weights:
        name, tensor = (item.hf_name, item) if isinstance(item, GGUFTensor) else item
        if rename is not None:
            name = rename(name)
            if name is None:
                continue
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        mapped = remap(name) if remap else None  # an MoE's experts and router (models/moe.py)
        module_name, _, param_kind = (mapped[0] if mapped else name).rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        shard_id = mapped[1] if mapped else None
        if leaf in packed and not mapped:
            fused, shard_id = packed[leaf]
            module_name = f"{parent}.{fused}"
        param = params.get(f"{module_name}.{param_kind}")
        if param is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
        module = model.get_submodule(module_name)
        try:
            part = getattr(module, "checkpoint_slice", lambda *_: None)(shard_id, param_kind)
            if part is not None:  # this tensor-parallel rank's slice, still unread
                tensor = tensor.narrow(*part)
            keeps_blocks = (isinstance(tensor, GGUFTensor) and tensor.is_quantized
                            and param_kind == "weight" and len(tensor.shape) == 2)
            if _deferred_experts(module, tensor, shard_id):
                pass  # blocks kept below; dequantized only if the experts run in float
            elif defer_quantized and keeps_blocks:
                defer(param, functools.partial(_fill, param, tensor, shard_id, name))
            else:
                _fill(param, tensor, shard_id, name)
        except ValueError as e:
            raise ModelLoadError(f"checkpoint tensor {name!r}: {e}") from None
        cover = getattr(module, "shard_cover", None)  # a stacked tensor fills many shards
        loaded.setdefault(f"{module_name}.{param_kind}", set()).update(
            cover(shard_id) if cover else {shard_id})
        # stacked experts (E, rows, cols) keep their blocks too: per expert, the rows of
        # its part in the stack (quant/moe_experts.py runs them natively)
        if isinstance(tensor, GGUFTensor) and tensor.is_quantized and param_kind == "weight" \
                and len(tensor.shape) in (2, 3):
            if len(tensor.shape) == 3:
                stacked_rows = getattr(module, "stacked_rows", None)
                if stacked_rows is None or stacked_rows(shard_id) is None:
                    continue
                row_offset = stacked_rows(shard_id)
            else:
                row_offset = (module.shard_rows(shard_id)[0] if hasattr(module, "shard_rows")
                              else 0)
            shards = module.__dict__.setdefault("gguf_quantized", [])
            blocks = tensor.raw_blocks()
            shards.append(QuantizedWeight(tensor.qtype, blocks, tensor.shape, row_offset))
            shards.sort(key=lambda w: w.row_offset)
            if len(tensor.shape) == 3:  # the float stack, if ever needed, from these bytes
                module.defer(shard_id, tensor.shape, functools.partial(
                    _dequantized, blocks, tensor.qtype, tuple(tensor.shape)))
    _check_all_loaded(model, params, loaded)
    if tied and hasattr(model, "lm_head"):
        embed = model.get_submodule("model.embed_tokens")
        if "gguf_quantized" in embed.__dict__:
            model.lm_head.gguf_quantized = embed.gguf_quantized


def _fill(param: nn.Parameter, tensor: Any, shard_id: Any, name: str) -> None:
    """Write one checkpoint tensor (a torch tensor, or a GGUFTensor dequantized now)
    into `param` (its shard `shard_id` of a fused one)."""
    try:
        value = tensor if isinstance(tensor, torch.Tensor) else tensor.load()
        param.weight_loader(param, value, shard_id)  # type: ignore[attr-defined]
    except ValueError as e:
        raise ModelLoadError(f"checkpoint tensor {name!r}: {e}") from None


def _deferred_experts(module: nn.Module, tensor: Any, shard_id: Any) -> bool:
    """Whether this is a GGUF stack of quantized experts (E, rows, cols) whose float
    stack waits: most runs keep the experts in records (quant/moe_experts.py), and a
    dequantized stack (3.5x the file's bytes) written now would raise the load's peak
    memory for nothing. The stacked weight fills itself on first use otherwise."""
    from tokenmill.loaders.gguf import GGUFTensor

    return (isinstance(tensor, GGUFTensor) and tensor.is_quantized and len(tensor.shape) == 3
            and hasattr(module, "defer") and module.stacked_rows(shard_id) is not None)


def _dequantized(blocks: torch.Tensor, qtype: Any, shape: tuple[int, ...]) -> torch.Tensor:
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(blocks.numpy(), qtype).reshape(shape))


def _check_all_loaded(model: nn.Module, params: dict[str, nn.Parameter],
                      loaded: dict[str, set[Any]]) -> None:
    missing = []
    for pname in params:
        module = model.get_submodule(pname.rpartition(".")[0])
        expected = set(getattr(module, "shard_offsets", {None: None}))
        got = loaded.get(pname, set())
        if got != expected:
            shards = sorted(str(s) for s in expected - got)
            missing.append(pname + (f" (shards {', '.join(shards)})" if shards != ["None"] else ""))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"the checkpoint lacks {', '.join(missing[:5])}{more}")
