"""What the bench can learn of the target server's configuration, for `config.server_config`.

tokenmill answers `GET /server_info` with a flat dict (tokenmill/server/server_info.py);
vLLM answers it (when its dev endpoints are on) with `{"vllm_config": "<repr>"}`, whose
`key=value` pairs are parsed here into the same names. Anything else gives None: explain
then says it does not know which levers are already pulled.
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


async def fetch_server_config(base_url: str, api_key: str | None) -> dict[str, Any] | None:
    """The target's configuration from its `/server_info`, or None when it has none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/").removesuffix("/v1") + "/server_info"
    try:
        async with httpx.AsyncClient(timeout=10.0, headers=headers) as http:
            resp = await http.get(url)
        return normalize(resp.json()) if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
