"""`tokenmill serve`: the OpenAI-compatible server (FastAPI + uvicorn).

Imports stay light here; torch and FastAPI load only when `serve` runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from typing import Any

from tokenmill.cli.engine_args import add_engine_args, engine_config_from_args, parse_bytes
from tokenmill.startup_timer import mark


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible server (completions, chat, SSE)")
    add_engine_args(serve, max_num_seqs=128, max_num_batched_tokens=256)
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on (default loopback; 0.0.0.0 exposes it)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model names clients may send; responses carry the first "
                   "(default: the engine's model name)")
    g.add_argument("--api-key", action="extend", nargs="+", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1, /tokenize and "
                   "/detokenize; repeat it (or give several) to accept any of several keys; "
                   "TOKENMILL_API_KEY and VLLM_API_KEY add one each")
    g.add_argument("--metrics-auth", action="store_true",
                   help="/metrics needs an API key too (default off, as vLLM)")
    g.add_argument("--log-prompts", action="store_true",
                   help="log each request's prompt text (default: never logged)")
    g.add_argument("--max-stream-backlog", type=int, default=None,
                   help="outputs a stream may hold unread before its request is aborted "
                   "(a client that stopped reading; default 512)")
    g.add_argument("--max-waiting", type=int, default=None,
                   help="refuse new requests with 503 when this many wait for a slot")
    g.add_argument("--max-request-size", type=parse_bytes, default="8MiB",
                   help="largest request body accepted (413 above it)")
    g.add_argument("--shutdown-timeout", type=float, default=20.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--engine-in-process", action="store_true",
                   help="run the engine loop in this process (on its main thread, HTTP on "
                   "another) instead of an engine core process of its own")
    g.add_argument("--engine-hang-timeout", type=float, default=10.0,
                   help="seconds without a heartbeat or output from the engine core after "
                   "which /health says 503 and in-flight requests fail")
    g.add_argument("--keep-serving-after-engine-death", action="store_true",
                   help="when the engine core dies, keep answering 503 instead of exiting "
                   "non-zero (the default, as vLLM: a supervisor restarts the server)")
    g.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="send usage.prompt_tokens_details.cached_tokens (default on, as "
                   "OpenAI; vLLM's default is off)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model call tools on its own (tool_choice "auto"); '
                   "needs --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral", "pythonic"],
                   help="the format the model writes its tool calls in (vLLM's names)")
    g.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="split the model's <think>...</think> reasoning into "
                   "reasoning_content (chat) and a reasoning item (/v1/responses)")
    g.add_argument("--responses-store-size", type=int, default=1024,
                   help="responses kept for GET /v1/responses/{id} and previous_response_id "
                   "(least recently used evicted first; 0 stores none)")
    g.add_argument("--allow-unknown-fields", action="store_true",
                   help="ignore unknown request fields with a warning instead of a 400")
    g.add_argument("--log-level", default="info", choices=_LOG_LEVELS)
    v = serve.add_argument_group("vLLM compatibility (same names and meanings)")
    v.add_argument("--uvicorn-log-level", default=None, choices=[*_LOG_LEVELS, "trace"],
                   help="uvicorn's own log level (default: --log-level)")
    v.add_argument("--disable-log-requests", action="store_true",
                   help="accepted: tokenmill never logs request contents")
    v.add_argument("--trust-remote-code", action="store_true",
                   help="accepted; a checkpoint that needs its own Python code is refused "
                   "either way (tokenmill runs only its built-in architectures)")
    v.add_argument("--revision", default=None,
                   help="a Hub model's branch, tag or commit (default: main)")
    v.add_argument("--download-dir", default=None,
                   help="where Hub models are cached (default: HF_HUB_CACHE / HF_HOME's)")
    v.add_argument("--gguf-file", default=None,
                   help="a GGUF repo on the Hub: the file to serve (or ORG/NAME:QUANT)")
    v.add_argument("--metrics-prefix", default="tokenmill", choices=["tokenmill", "vllm"],
                   help="'vllm': /metrics under vLLM's names and labels (vllm:...)")
    v.add_argument("--generation-config", default="auto",
                   help="'auto': the checkpoint's generation_config.json sets the sampling "
                   "defaults a request leaves unset; 'vllm': ignore it; or a directory")
    v.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file, or the text) instead of the model's")
    v.add_argument("--chat-template-content-format", default="auto",
                   choices=["auto", "string", "openai"],
                   help="message content as a string or as OpenAI's list of parts "
                   "(auto: what the template loops over)")
    serve.set_defaults(func=run_serve)


_LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mark("interpreter, CLI imports, flags parsed")
    if args.max_waiting is not None and args.max_waiting < 0:
        raise SystemExit("--max-waiting must be non-negative")
    if args.engine_hang_timeout <= 0:
        raise SystemExit("--engine-hang-timeout must be positive")
    api_keys = api_keys_of(args.api_key, os.environ)
    if args.metrics_auth and not api_keys:
        raise SystemExit("--metrics-auth needs an API key (--api-key, TOKENMILL_API_KEY "
                         "or VLLM_API_KEY)")
    if args.max_stream_backlog is not None and args.max_stream_backlog < 1:
        raise SystemExit("--max-stream-backlog must be at least 1")
    try:
        _fetch_hub_model(args)
        serving_config = _serving_config(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    mark("model resolved, server flags checked")
    if args.engine_in_process:
        _check_startup_choices(args)
        return _serve_in_process(args, serving_config, api_keys)
    return _serve_with_core_process(args, serving_config, api_keys)


def _check_startup_choices(args: argparse.Namespace) -> None:
    from tokenmill.engine.core.builder import check_startup_choices

    try:  # BackendUnavailable: exit 2
        check_startup_choices(engine_config_from_args(args))
    except ValueError as e:  # e.g. a --tensor-parallel-size the model does not split
        raise SystemExit(f"tokenmill serve: error: {e}") from None
    mark("engine imports, start-up choices checked")


def _prepare_front_end(tokenizer: Any) -> None:
    """The front end's own start-up, done while the engine core loads: the HTTP
    stack's imports (FastAPI, the routes) and what the server derives from the
    tokenizer alone (cached), so that little is left once the core is ready. The
    start-up choices that need torch to check (--attention-backend,
    --kv-cache-dtype, the TP size) are the core's to refuse: it prints the usage
    error and exits 2, and so does `serve`."""
    import tokenmill.server.api  # noqa: F401 - imported now, used once the core is ready
    from tokenmill.server.tokenizer_pool import max_token_bytes

    mark("HTTP stack imported")
    max_token_bytes(tokenizer)
    mark("tokenizer's longest entry measured")


def _backlog(args: argparse.Namespace) -> dict:
    return {} if args.max_stream_backlog is None else \
        {"max_stream_backlog": args.max_stream_backlog}


def _uvicorn_server(args: argparse.Namespace, engine: Any, serving_config: Any,
                    api_keys: list[str]) -> Any:
    import uvicorn

    from tokenmill.server.api import build_app

    class Server(uvicorn.Server):
        """uvicorn's server, plus: shortly before --shutdown-timeout is up, what is still
        in flight ends with the "aborted" error event. uvicorn closes the connections
        still open at the timeout before its lifespan shutdown aborts their requests,
        so without this a client would see a cut stream instead of the event."""

        deadline_armed = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            timeout_s = self.config.timeout_graceful_shutdown
            if timeout_s is not None and not self.deadline_armed:
                self.deadline_armed = True
                lead = min(2.0, timeout_s / 2)  # time for the events to reach clients
                timer = threading.Timer(timeout_s - lead, engine.abort_in_flight)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    app = build_app(engine, served_model_name=args.served_model_name, api_key=api_keys,
                    max_request_bytes=args.max_request_size, config=serving_config,
                    metrics_auth=args.metrics_auth)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level or args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    return Server(config)


def _serve_with_core_process(args: argparse.Namespace, serving_config: Any,
                             api_keys: list[str]) -> int:
    from tokenmill.engine.frontend.core_client import CoreClient, CoreStartError, CoreUsageError
    from tokenmill.server.engine_watchdog import exit_on_engine_death

    try:
        # on the main thread: the core's PR_SET_PDEATHSIG follows the thread that forks
        client = CoreClient(engine_config_from_args(args), max_waiting=args.max_waiting,
                            hang_timeout_s=args.engine_hang_timeout, log_level=args.log_level,
                            while_loading=_prepare_front_end, **_backlog(args))
    except CoreUsageError:
        return 2  # the core said why, in one line
    except CoreStartError as e:
        logging.getLogger(__name__).error("%s", e)
        return 1
    try:
        # uvicorn on the main thread, as usual: SIGTERM / SIGINT drain in-flight
        # requests (--shutdown-timeout), then its lifespan stops the core. Once
        # done, uvicorn re-raises the signal to the handler it found installed:
        # that is this one, so we go on to exit 0 instead of dying of SIGTERM.
        server = _uvicorn_server(args, client, serving_config, api_keys)
        mark("HTTP app built (FastAPI, routes)")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, server.handle_exit)
        engine_died = (lambda: False) if args.keep_serving_after_engine_death else \
            exit_on_engine_death(server, client.dead_reason)
        try:
            server.run()
        except SystemExit:  # uvicorn's exit(3) when it cannot bind: ours is 1
            pass
    finally:
        client.shutdown()
    return 0 if server.started and not engine_died() else 1


def _serve_in_process(args: argparse.Namespace, serving_config: Any,
                      api_keys: list[str]) -> int:
    from tokenmill.engine.core.llm_engine import LLMEngine
    from tokenmill.engine.frontend.async_engine import AsyncEngine

    llm = LLMEngine(engine_config_from_args(args), precompile_now=False)
    engine = AsyncEngine(llm, max_waiting=args.max_waiting, **_backlog(args))
    server = _uvicorn_server(args, engine, serving_config, api_keys)

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
    llm.precompile.start()  # off the start-up path, on the engine loop's thread count
    engine.run()
    died = engine.health()[0] is False and not server.should_exit
    if died and not args.keep_serving_after_engine_death:  # see engine_watchdog.py
        logging.getLogger(__name__).error("the engine loop died: exiting")
        server.should_exit = True
    while http.is_alive():  # the engine died: keep answering 503 until told to stop
        http.join(0.5)
    return 1 if died else (0 if server.started else 1)


def _fetch_hub_model(args: argparse.Namespace) -> None:
    """A model named by its Hub id (not a path, not a built-in name): fetched
    (cache first), then served from its local copy under the name ORG/NAME."""
    from tokenmill.loaders.hub import fetch_model, looks_like_hub_id
    from tokenmill.loaders.model_source import EMBEDDED_MODELS

    hub_flags = [f for f in ("revision", "download_dir", "gguf_file") if getattr(args, f)]
    if args.model.lower() in EMBEDDED_MODELS or not looks_like_hub_id(args.model):
        if hub_flags:
            raise ValueError(f"--{hub_flags[0].replace('_', '-')} is for a model named by its "
                             f"Hugging Face Hub id (ORG/NAME); {args.model!r} is not one")
        return
    repo_id = args.model
    args.model = str(fetch_model(repo_id, args.revision, args.download_dir, args.gguf_file))
    if args.served_model_name is None:
        args.served_model_name = [repo_id.partition(":")[0]]


def api_keys_of(flags: list[str] | None, environ: Any) -> list[str]:
    """Every accepted key: each --api-key, then TOKENMILL_API_KEY and VLLM_API_KEY."""
    keys = list(flags or [])
    keys += [environ[name] for name in ("TOKENMILL_API_KEY", "VLLM_API_KEY")
             if environ.get(name)]
    return list(dict.fromkeys(k for k in keys if k))


def _serving_config(args: argparse.Namespace) -> Any:
    """What the server flags change, checked before the model loads."""
    from tokenmill.loaders.model_source import resolve_model
    from tokenmill.server.chat_template import load_chat_template
    from tokenmill.server.generation_config import load_generation_defaults
    from tokenmill.server.serving_config import ServingConfig

    source = resolve_model(args.model)
    refuse_remote_code(source)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return ServingConfig(
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        allow_unknown_fields=args.allow_unknown_fields,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        metrics_prefix=args.metrics_prefix,
        generation_defaults=load_generation_defaults(args.generation_config, source),
        chat_template=load_chat_template(args.chat_template),
        chat_template_content_format=args.chat_template_content_format,
        log_prompts=args.log_prompts, reasoning_parser=args.reasoning_parser,
        responses_store_size=args.responses_store_size)


def refuse_remote_code(source: Any) -> None:
    """vLLM runs a checkpoint's own modelling code under --trust-remote-code;
    tokenmill never does, so such a checkpoint is refused with the reason."""
    import json

    from tokenmill.config import SUPPORTED_ARCHITECTURES

    if source.kind != "hf":
        return
    try:
        cfg = json.loads((source.path / "config.json").read_text())
    except (OSError, ValueError):
        return  # the loader reports an unreadable config itself
    arch = (cfg.get("architectures") or [""])[0]
    if cfg.get("auto_map") and arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source.path} needs its own Python code ({arch or 'auto_map'} in config.json); "
            "tokenmill does not run checkpoint code, with or without --trust-remote-code. "
            f"It runs {', '.join(SUPPORTED_ARCHITECTURES)}")
