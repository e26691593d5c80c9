"""OpenAI error objects: the exception routes raise, its JSON body, and the
FastAPI handlers that turn every failure (validation, 404, a bug) into one."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code),
                        status_code=err.status, headers=err.headers)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """FastAPI's validation errors (bad JSON, wrong types, out of bounds) as one 400."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({reason})".replace(" ()", ""),
                        code="invalid_json")
    unknown = [_param(e) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:  # OpenAI's words for a field it does not know
        return APIError(400, "Unrecognized request argument supplied: " + ", ".join(unknown),
                        param=unknown[0])
    loc = []
    for part in first.get("loc", ()):
        if part == "body" and not loc:
            continue
        if isinstance(part, str) and _is_union_tag(part):
            break  # the rest names a branch of a union type, not a field
        loc.append(str(part))
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing" and not loc:
        return APIError(400, "the request body is missing or not a JSON object")
    if param:
        msg = f"{param}: {msg}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problems)"
    return APIError(400, msg, param=param)


def _param(error: dict[str, Any]) -> str:
    loc = [str(p) for p in error.get("loc", ()) if not (isinstance(p, str) and _is_union_tag(p))]
    return ".".join(loc[1:] if loc[:1] == ["body"] else loc)


def _is_union_tag(part: str) -> bool:
    # pydantic names union branches by type: 'str', 'list[int]', 'TextPart', ...
    return "[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper()


def check_text(text: str, param: str) -> None:
    """Refuse text that cannot be encoded (a lone surrogate from JSON '\\ud800')."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param} is not valid Unicode text (lone surrogate)",
                       param=param) from None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), kind,
                                       headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(APIError(500, "internal server error", "server_error"))
