"""The OpenAI-compatible app: wires the serving state (`serving.Serving`), the
routes (`routes/`), the error handlers and the API-key / size gate together.

The engine lives behind an `EngineClient`: an engine core process's
`CoreClient`, or the in-process `AsyncEngine`, whose loop the caller runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from tokenmill.engine.frontend.engine_client import EngineClient
from tokenmill.server import protocol
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.gate import DEFAULT_MAX_REQUEST_BYTES, Gate
from tokenmill.server.routes import admin, chat, completions, lora, responses, tokenize
from tokenmill.server.serving import Serving, ServingConfig
from tokenmill.startup_timer import log_heavy_modules, mark
from tokenmill.version import __version__


def build_app(engine: EngineClient, served_model_name: str | None = None,
              api_key: str | list[str] | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              config: ServingConfig | None = None, metrics_auth: bool = False) -> FastAPI:
    """The app in front of `engine`; its lifespan's end shuts the engine down.
    `api_key`: one key or several, any of which is accepted."""
    serving = Serving(engine, served_model_name, config)
    protocol.allow_unknown_fields(serving.config.allow_unknown_fields)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        mark("HTTP server started: /health answers")
        log_heavy_modules()
        yield
        serving.tokenizers.shutdown()
        await asyncio.to_thread(serving.engine.shutdown)

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible LLM server")
    app.add_middleware(Gate, api_key=api_key, max_request_bytes=max_request_bytes,
                       metrics_auth=metrics_auth)
    install_error_handlers(app)
    for module in (admin, tokenize, completions, chat, responses, lora):
        app.include_router(module.router)
    app.state.serving = serving
    app.state.engine = engine
    app.state.metrics = serving.metrics
    return app
