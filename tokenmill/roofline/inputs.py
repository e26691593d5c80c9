"""What a roofline or explain command is told: a model, a weight format and a
piece of hardware, each turned into its object or a UsageError.

Below both commands (command.py, explain.py), so neither imports the other.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from tokenmill.config import ATTENTION_LINEARS, GGUF_ACTIVATIONS, gguf_activations
from tokenmill.roofline.arch import WeightBits
from tokenmill.roofline.hardware import Hardware, get_hardware
from tokenmill.roofline.source import ModelNotFound, ResolvedModel, resolve


class UsageError(ValueError):
    """Bad input: reported as one line on stderr, exit code 2."""


def load_model(spec: str) -> ResolvedModel:
    try:
        return resolve(spec)
    except ModelNotFound as e:
        raise UsageError(str(e)) from None


def weight_bits(model: ResolvedModel, dtype: str | None) -> WeightBits:
    path = dtype.lower() if dtype else None
    if path in GGUF_ACTIVATIONS:  # a GGUF path computes in its activations' dtype
        bits = model.default_bits if model.gguf_path else _embedded_gguf_bits(model, dtype)
        attention = gguf_activations(path, ATTENTION_LINEARS[0], model.arch.architecture)
        return replace(bits, compute_dtype=GGUF_ACTIVATIONS[path],
                       attention_compute_dtype=(None if attention == GGUF_ACTIVATIONS[path]
                                                else attention))
    if not path or path in ("auto", "none") or (
            model.gguf_path and path == model.default_bits.name.lower()):
        return model.default_bits
    try:
        return WeightBits.from_name(dtype)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _embedded_gguf_bits(model: ResolvedModel, dtype: str) -> WeightBits:
    """A GGUF path on a model named, not given as a file: the bits of the GGUF file the
    engine loads for that name (`smollm2-135m`: the embedded Q4_1 file, its tied
    embedding and LM head Q8_0), not the preset's bf16."""
    from tokenmill.loaders.errors import ModelSourceError
    from tokenmill.loaders.model_source import EMBEDDED_MODELS, resolve_model

    name = model.arch.name
    if name not in EMBEDDED_MODELS:
        raise UsageError(f"--dtype {dtype}: {name} is not a GGUF file; pass the .gguf file, "
                         "or a GGUF type (q4_1, q8_0, ...)")
    try:
        path = resolve_model(name).path
    except ModelSourceError as e:  # its package is not installed
        raise UsageError(f"--dtype {dtype}: {e}") from None
    return load_model(str(path)).default_bits


def load_hardware(name: str, bits: WeightBits, args: argparse.Namespace) -> Hardware:
    for flag in ("bandwidth", "flops", "cost_per_hour"):
        value = getattr(args, flag, None)
        if value is not None and (value < 0 or (value == 0 and flag != "cost_per_hour")):
            raise UsageError(f"--{flag.replace('_', '-')} must be positive, got {value:g}")
    try:
        hardware = get_hardware(name, remeasure=bool(getattr(args, "remeasure", False)))
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    return hardware.with_overrides(args.bandwidth, args.flops, bits.compute_dtype)
