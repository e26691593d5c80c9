"""Attention backends behind one seam, and the registry that picks one.

Backends are imported lazily: a backend whose libraries are missing costs
nothing until it is chosen. `auto` picks `cpu` on a CPU and `triton` on CUDA.
"""

from __future__ import annotations

import importlib

import torch

from tokenmill.attention.base import AttentionBackend, BackendUnavailable

# name -> "module:Class", imported only when chosen
_REGISTRY: dict[str, str] = {
    "torch": "tokenmill.attention.torch_ref:TorchBackend",
    "cpu": "tokenmill.attention.cpu:CpuBackend",
    "triton": "tokenmill.attention.triton:TritonBackend",
}

BACKEND_NAMES = ("auto", *_REGISTRY)


def _load(name: str) -> type[AttentionBackend]:
    module, cls = _REGISTRY[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise BackendUnavailable(f"attention backend {name!r} cannot be imported: {e}") from e


def _why_not(name: str, device: torch.device) -> str | None:
    try:
        return _load(name).unavailable_reason(device)
    except BackendUnavailable as e:
        return str(e)


def available_backends(device: torch.device) -> list[str]:
    return [name for name in _REGISTRY if _why_not(name, device) is None]


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" and _why_not("triton", device) is None \
            else ("cpu" if device.type == "cpu" else "torch")
    return name


def check_backend(name: str, device: torch.device) -> str:
    """The backend `name` (or `auto`) resolves to on `device`; raises
    BackendUnavailable, listing the available ones, when it is unknown or cannot
    run here. Cheap: the engine calls it before loading any weights."""
    if name not in BACKEND_NAMES:
        raise BackendUnavailable(
            f"unknown attention backend {name!r}; choose one of: {', '.join(BACKEND_NAMES)} "
            f"(available on {device.type}: {', '.join(available_backends(device))})")
    resolved = resolve_backend_name(name, device)
    reason = _why_not(resolved, device)
    if reason is not None:
        raise BackendUnavailable(
            f"attention backend {resolved!r} is not available on {device.type}: {reason} "
            f"(available: {', '.join(available_backends(device))})")
    return resolved


def get_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend `name` (or `auto`) for `device`; a clear error listing the
    available ones when it is unknown or cannot run here."""
    return _load(check_backend(name, device))(device, dtype)


__all__ = ["BACKEND_NAMES", "AttentionBackend", "BackendUnavailable", "available_backends",
           "check_backend", "get_backend", "resolve_backend_name"]
