"""What the bench can learn of the target server's configuration, for `config.server_config`.

tokenmill answers `GET /server_info` with a flat dict (tokenmill/server/server_info.py);
vLLM answers it (when its dev endpoints are on) with `{"vllm_config": "<repr>"}`, whose
`key=value` pairs are parsed here into the same names. llama-server has no such route; its
`GET /props` names the GGUF file it runs and its slots, read into the same names
(`quantization` gguf-a8: llama.cpp multiplies a GGUF's blocks by 8-bit activations on a
CPU, as tokenmill's gguf-a8 does). Anything else gives None: explain then says it does
not know which levers are already pulled.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import httpx

# vLLM's repr names -> ours (vLLM's engine-argument names)
_VLLM_KEYS = {
    "model": "model", "dtype": "dtype", "quantization": "quantization",
    "max_seq_len": "max_model_len", "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
    "chunked_prefill_enabled": "enable_chunked_prefill",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "enable_prefix_caching": "enable_prefix_caching", "block_size": "block_size",
    "kv_cache_dtype": "kv_cache_dtype", "cache_dtype": "kv_cache_dtype",
}


def parse_vllm_config(text: str) -> dict[str, Any]:
    """`key=value, ...` pairs of vLLM's config repr, the ones explain reads."""
    out: dict[str, Any] = {"engine": "vllm"}
    for key, raw in re.findall(r"(\w+)=('[^']*'|[\w.+-]+)", text):
        if key not in _VLLM_KEYS or _VLLM_KEYS[key] in out:
            continue
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[_VLLM_KEYS[key]] = value
    if "speculative_config=None" not in text and "speculative_config=" in text:
        out["speculative"] = "on"
    elif "speculative_config=None" in text:
        out["speculative"] = None
    return out


def normalize(body: Any) -> dict[str, Any] | None:
    if not isinstance(body, dict):
        return None
    if body.get("engine") == "tokenmill":
        return body
    vllm = body.get("vllm_config")
    if isinstance(vllm, str):
        return parse_vllm_config(vllm)
    if isinstance(vllm, dict):  # ?config_format=json
        flat: dict[str, Any] = {"engine": "vllm"}
        for section in vllm.values():
            if isinstance(section, dict):
                for key, value in section.items():
                    if key in _VLLM_KEYS and _VLLM_KEYS[key] not in flat:
                        flat[_VLLM_KEYS[key]] = value
        return flat
    return None


def normalize_llama_props(body: Any) -> dict[str, Any] | None:
    """llama-server's `/props` (model_path, total_slots, ...) in /server_info's names."""
    if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
        return None
    out: dict[str, Any] = {"engine": "llama.cpp", "model": body["model_path"],
                           "quantization": "gguf-a8"}
    if isinstance(body.get("model_ftype"), str):
        out["gguf_type"] = body["model_ftype"]
    if isinstance(body.get("total_slots"), int):
        out["max_num_seqs"] = body["total_slots"]
    return out


async def fetch_server_config(base_url: str, api_key: str | None) -> dict[str, Any] | None:
    """The target's configuration from its `/server_info` (else llama-server's `/props`),
    or None when it has neither."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        async with httpx.AsyncClient(timeout=10.0, headers=headers) as http:
            resp = await http.get(root + "/server_info")
            if resp.status_code == 200:
                return normalize(resp.json())
            resp = await http.get(root + "/props")
        return normalize_llama_props(resp.json()) if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
