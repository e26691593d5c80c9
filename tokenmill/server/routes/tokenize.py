"""vLLM's /tokenize and /detokenize."""

from __future__ import annotations

from fastapi import APIRouter

from tokenmill.server import protocol as p
from tokenmill.server.json_body import OffLoopJSONRoute
from tokenmill.server.serving import ServingDep

router = APIRouter(route_class=OffLoopJSONRoute)


@router.post("/tokenize", response_model=p.TokenizeResponse)
async def tokenize(req: p.TokenizeRequest,
                   serving: ServingDep) -> p.TokenizeResponse:
    serving.check_model(req.model)
    if req.messages is not None:
        ids = await serving.render_chat(req.messages, req)
    else:
        ids = await serving.encode(req.prompt or "", req.add_special_tokens)
    return p.TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len,
                              tokens=list(ids))


@router.post("/detokenize", response_model=p.DetokenizeResponse)
async def detokenize(req: p.DetokenizeRequest,
                     serving: ServingDep) -> p.DetokenizeResponse:
    serving.check_model(req.model)
    serving.check_token_ids(req.tokens, "tokens")
    return p.DetokenizeResponse(prompt=await serving.decode(req.tokens))
