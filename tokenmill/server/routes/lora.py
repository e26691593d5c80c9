"""vLLM's runtime adapter routes: /v1/load_lora_adapter and /v1/unload_lora_adapter.

Off unless VLLM_ALLOW_RUNTIME_LORA_UPDATING (or TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING)
is true, as in vLLM; the API key, when set, guards them like every route (the Gate)."""

from __future__ import annotations

import asyncio
import contextvars
import os
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from tokenmill.server.errors import APIError
from tokenmill.server.serving import ServingDep

router = APIRouter()

# the adapter the current HTTP request's `model` names (set by Serving.check_model,
# read by Serving.submit: each request handler runs in its own context)
current_lora: contextvars.ContextVar[Any] = contextvars.ContextVar("current_lora",
                                                                    default=None)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def _allowed() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true")
               for k in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING",
                         "TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING"))


def _manager(serving: Any) -> Any:
    if not _allowed():
        raise APIError(404, "runtime LoRA updating is off: set "
                       "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True", code="not_found")
    manager = getattr(serving.engine.engine, "lora", None)
    if manager is None:
        raise APIError(400, "LoRA is off: start the server with --enable-lora",
                       param="lora_name")
    return manager


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoRAAdapterRequest, serving: ServingDep
                            ) -> PlainTextResponse:
    from tokenmill.loaders.errors import LoRAAdapterError

    manager = _manager(serving)
    if req.lora_name in serving.model_names:
        raise APIError(400, f"{req.lora_name!r} is the base model's name", param="lora_name")
    try:
        await asyncio.to_thread(manager.add, req.lora_name, req.lora_path)
    except LoRAAdapterError as e:
        raise APIError(400, str(e), param=e.param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, serving: ServingDep
                              ) -> PlainTextResponse:
    from tokenmill.loaders.errors import LoRAAdapterError
    from tokenmill.lora_request import UnknownLoRAError

    manager = _manager(serving)
    try:
        # beside an engine core process this waits for the core's answer
        await asyncio.to_thread(manager.remove, req.lora_name)
    except UnknownLoRAError as e:
        raise APIError(404, str(e), param="lora_name", code="model_not_found") from None
    except LoRAAdapterError as e:
        raise APIError(400, str(e), param=e.param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
