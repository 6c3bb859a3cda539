"""The app factory: an OpenAI-compatible API (and Anthropic's Messages) over one Engine that loads in a thread while
the server already answers; the guards every route passes, and the error handlers.

The routes live with their API: openai.py, anthropic.py, admin.py (health, metrics, the ledger, tokenize, flush,
router info). The engine runs in its own thread; the event loop only tokenizes (in the thread pool), submits through
the engine's door (engine/door.py) and relays outputs. Every error leaves as OpenAI's `{"error": {...}}` (Anthropic's
shape under /v1/messages) with the status a client expects; an internal failure fails the one request it happened in.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from deltaserve.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.errors import internal_error
from deltaserve.server import admin, anthropic, anthropic_wire, openai, protocol, responses
from deltaserve.server.drain import DrainGate
from deltaserve.server.guard import LOOPBACK_HOSTS, RequestGuard, is_loopback
from deltaserve.server.openai_wire import request_body_schemas
from deltaserve.server.state import ANTHROPIC_PATH, ApiError, ServerState


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def create_app(config: EngineConfig, *, load_engine: Callable[[EngineConfig], Engine] | None = None,
               on_load_failure: Callable[[BaseException], None] | None = None,
               log: Callable[[str], None] = _stderr, freeze_after_load: bool = False) -> FastAPI:
    """The FastAPI app; at startup it loads the engine in a thread, answering 503 until the engine is ready.

    freeze_after_load (the `serve` process, which holds one engine for its life): what loading made (the tokenizer's
    vocabulary, the modules, the imports: ~385,000 objects for SmolLM2) is moved out of the collector's generations,
    so that a full collection no longer walks it: one took ~145 ms on 2 cores, a pause in every stream of the step it
    fell in. Not for a process that makes and drops engines (the tests): frozen cycles are never collected."""
    state = ServerState(config=config, log=log)
    load = load_engine or (lambda c: Engine(c, log=log))

    def load_in_thread() -> None:
        try:
            template = _read_chat_template(config)
            engine = load(config)
            if template is not None:
                engine.tokenizer.use_chat_template(template)
            engine.start()
            if freeze_after_load:
                gc.collect()
                gc.freeze()
            state.engine = engine
            log(f"deltaserve: ready, serving {state.served_name()!r}")
        except BaseException as e:  # the server reports it and stops; nothing else is left to do in this thread
            state.load_error = e
            log(f"deltaserve: the model failed to load: {e}")
            if on_load_failure is not None:
                on_load_failure(e)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=load_in_thread, name="deltaserve-load", daemon=True).start()
        yield
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="deltaserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API of a deltaserve engine")
    app.state.server = state
    _add_error_handlers(app, state)
    _add_guards(app, state)
    admin.add_routes(app, state)
    openai.add_routes(app, state)
    anthropic.add_routes(app, state)
    responses.add_routes(app, state)
    _use_request_schemas(app)
    return app


def _read_chat_template(config: EngineConfig) -> str | None:
    """--chat-template FILE, read before the model loads so a wrong path fails at once."""
    if config.chat_template is None:
        return None
    try:
        return open(config.chat_template, encoding="utf-8").read()
    except OSError as e:
        raise OSError(f"--chat-template {config.chat_template}: {e.strerror}") from None


def _add_guards(app: FastAPI, state: ServerState) -> None:
    """Host, key and content-type checks on every route, then the drain's gate (503 while shutting down); CORS only
    when origins are named (a browser page may then read answers, so it is the operator's explicit choice)."""
    config = state.config
    allowed_hosts = (*LOOPBACK_HOSTS, *config.allowed_hosts) if is_loopback(config.host) else None

    def count_error(status: int, type_: str) -> None:
        state.metrics.errors.labels(str(status), type_).inc()

    app.add_middleware(DrainGate, drain=state.drain, anthropic_path=ANTHROPIC_PATH, on_error=count_error)
    app.add_middleware(RequestGuard, api_key=config.api_key, allowed_hosts=allowed_hosts,
                       on_error=count_error)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key"])


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    def error_response(request: Request, status: int, message: str, param=None, code=None,
                       headers=None) -> JSONResponse:
        type_ = protocol.error_type(status)
        state.metrics.errors.labels(str(status), type_).inc()
        if request.url.path.startswith(ANTHROPIC_PATH):  # Anthropic's clients read their own error shape
            return JSONResponse(anthropic_wire.error_body(status, message), status_code=status, headers=headers)
        return JSONResponse(protocol.error_body(message, type_, param, code), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(request, e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(protocol.ProtocolError)
    async def bad_request(request: Request, e: protocol.ProtocolError):
        return error_response(request, 400, e.message, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = f"{request.method} {request.url.path}: {e.detail}"
        return error_response(request, e.status_code, message, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        problem = e.errors()[0] if e.errors() else {"msg": "invalid request"}
        return error_response(request, 400, f"{'.'.join(map(str, problem.get('loc', ())))}: {problem['msg']}")

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, e: ClientDisconnect):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, e: Exception):
        message = internal_error(state.log, f"{request.method} {request.url.path}", e)
        return error_response(request, 500, message, code="internal_error")


def _use_request_schemas(app: FastAPI) -> None:
    """The routes read their bodies themselves (with a size limit); document them anyway."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(request_body_schemas())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
