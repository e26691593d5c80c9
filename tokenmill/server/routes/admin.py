"""Health, Prometheus metrics, version and the model list."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.core.server_info import server_info
from tokenmill.server import protocol as p
from tokenmill.server.errors import error_body
from tokenmill.server.metrics import CONTENT_TYPE
from tokenmill.server.serving import ServingDep
from tokenmill.version import __version__

router = APIRouter()


@router.get("/health")
async def health(serving: ServingDep) -> Response:
    ok, reason = serving.engine.health()
    if ok:
        return Response(status_code=200)
    return JSONResponse(error_body(reason, "service_unavailable_error"), status_code=503)


@router.get("/metrics")
async def prometheus_metrics(serving: ServingDep) -> Response:
    return Response(serving.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/server_info")
async def server_info_route(serving: ServingDep) -> dict:
    """What this server runs, with vLLM's engine-argument names (tokenmill bench records
    it; explain then skips levers already pulled)."""
    llm = serving.engine.engine  # an LLMEngine in-process; the core's own dict otherwise
    info = getattr(llm, "server_info", None)
    return info if isinstance(info, dict) else server_info(llm)


@router.get("/v1/models", response_model=p.ModelList)
async def models(serving: ServingDep) -> p.ModelList:
    manager = getattr(serving.engine.engine, "lora", None)
    adapters = [p.ModelCard(id=name, root=req.lora_path, parent=serving.model_name,
                            max_model_len=serving.max_model_len)
                for name, req in (manager.served.items() if manager is not None else [])]
    return p.ModelList(data=[*[p.ModelCard(id=name, root=serving.root_model_name,
                                           max_model_len=serving.max_model_len)
                               for name in serving.model_names], *adapters])
