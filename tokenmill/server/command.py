"""`tokenmill serve`: the OpenAI-compatible server (FastAPI + uvicorn).

Imports stay light here; torch and FastAPI load only when `serve` runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from tokenmill.engine.args import add_engine_args, engine_config_from_args, parse_bytes


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible server (completions, chat, SSE)")
    add_engine_args(serve)
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on (default loopback; 0.0.0.0 exposes it)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="model name clients send (default: the engine's model name)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (or set TOKENMILL_API_KEY)")
    g.add_argument("--max-waiting", type=int, default=None,
                   help="refuse new requests with 503 when this many wait for a slot")
    g.add_argument("--max-request-size", type=parse_bytes, default="8MiB",
                   help="largest request body accepted (413 above it)")
    g.add_argument("--shutdown-timeout", type=float, default=20.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.api import build_app

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_waiting is not None and args.max_waiting < 0:
        raise SystemExit("--max-waiting must be non-negative")
    api_key = args.api_key or os.environ.get("TOKENMILL_API_KEY") or None
    engine = AsyncEngine(LLMEngine(engine_config_from_args(args)),
                         max_waiting=args.max_waiting)
    app = build_app(engine, served_model_name=args.served_model_name, api_key=api_key,
                    max_request_bytes=args.max_request_size)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    server = uvicorn.Server(config)

    def serve_http() -> None:
        try:
            server.run()
        finally:  # however HTTP ended (shutdown, or a port it could not bind)
            engine.stop()

    # The engine loop runs here, on the main thread, and HTTP on another
    # (async_engine.py says why). uvicorn catches signals only on the main thread,
    # so SIGTERM / SIGINT are routed to it by hand: it drains in-flight requests
    # (--shutdown-timeout), its lifespan stops the engine loop, and we exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    http = threading.Thread(target=serve_http, name="tokenmill-http")
    http.start()
    engine.run()
    while http.is_alive():  # the engine died: keep answering 503 until told to stop
        http.join(0.5)
    return 0 if server.started else 1
