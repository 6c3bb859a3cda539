"""The HTTP routes: an OpenAI-compatible API over one Engine that loads in a thread while the server already answers.

The engine runs in its own thread; the event loop only tokenizes (in the thread pool), submits and relays outputs.
Every error leaves as OpenAI's `{"error": {...}}` with the status a client expects; an internal failure fails the
one request it happened in.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from deltaserve.config import EngineConfig
from deltaserve.images import ImageError, ImageSource, PreparedImage, preprocess, read_source
from deltaserve.engine.engine import Engine, QueueFull, RequestRefused
from deltaserve.engine.errors import internal_error
from deltaserve.engine.request import RequestStream, SamplingParams
from deltaserve.text.tokenizer import ChatTemplateError
from deltaserve.server import anthropic, protocol, router_info
from deltaserve.server.drain import REFUSED, RETRY_AFTER_S, Drain, DrainGate
from deltaserve.server.generation import EventStream, Generation, GenerationFailed, chat_events, completion_events
from deltaserve.server.chat_setup import OutputRequestError, chat_output
from deltaserve.server.guard import LOOPBACK_HOSTS, RequestGuard, is_loopback
from deltaserve.server.metrics import ServerMetrics
from deltaserve.text.chat_output import ChatOutputParser, parse_whole

ANTHROPIC_PATH = "/v1/messages"
DISCONNECT_POLL_S = 0.1  # how often a non-streamed request checks that its client is still there
LOADING_RETRY_AFTER_S = 5
STOP_TAIL_TOKENS = 16  # decoded end of an output, where a stop sequence that ended it is found
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    """An error response: status, one-line message, and the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


@dataclass
class ServerState:
    """What the routes share: settings, metrics, and the engine once it has loaded."""

    config: EngineConfig
    log: Callable[[str], None]
    engine: Engine | None = None
    load_error: BaseException | None = None
    started_s: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics = field(init=False)
    drain: Drain = field(init=False)  # serve.py runs it on SIGTERM / SIGINT

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(lambda: self.engine.stats() if self.engine is not None else None)
        self.drain = Drain(self.config.shutdown_timeout_s, self.log)

    def ready_engine(self) -> Engine:
        if self.engine is not None:
            return self.engine
        if self.load_error is not None:
            raise ApiError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
        raise ApiError(503, "the model is still loading; retry when GET /health answers 200", code="model_loading",
                       headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})

    def served_name(self) -> str:
        return self.config.served_model_name or self.engine.model_name

    def check_model(self, name: str | None) -> None:
        """A request may name the served name, the engine's own name or the --model path (or none)."""
        accepted = {self.served_name(), self.engine.model_name, self.config.model}
        if name is not None and name not in accepted:
            raise ApiError(404, f"model {name!r} does not exist: this server serves {self.served_name()!r}",
                           param="model", code="model_not_found")


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
    _add_routes(app, state)
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
            return JSONResponse(anthropic.error_body(status, message), status_code=status, headers=headers)
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


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        if state.engine is None:
            try:
                state.ready_engine()
            except ApiError as e:
                body = protocol.error_body(e.message, protocol.error_type(503), code=e.code)
                return JSONResponse(body, 503, e.headers)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        engine = state.ready_engine()
        return protocol.model_list([state.served_name()], state.started_s, engine.context_length)

    @app.get("/v1/budget")
    async def budget():
        engine = state.ready_engine()
        budget_json = engine.budget.to_json()
        body = json.loads(budget_json) if isinstance(budget_json, str) else budget_json
        s = engine.stats()
        body["prefix_cache"] = {"enabled": engine.prefix_cache is not None, "pages": s.prefix_cache_pages,
                                "hit_tokens_total": s.prefix_cache_hit_tokens_total,
                                "checkpoints_used": s.checkpoints_used, "checkpoints_total": s.checkpoints_total}
        return body

    @app.post("/flush_cache")
    async def flush_cache():
        """Drop every cached page and checkpoint that no running request uses."""
        return {"freed_pages": state.ready_engine().flush_cache()}

    # What a router (sglang-router) asks of a worker: its served model name, its model, its load.
    @app.get("/server_info")
    @app.get("/get_server_info", include_in_schema=False)
    async def server_info():
        return router_info.server_info(state.ready_engine(), state.served_name())

    @app.get("/model_info")
    @app.get("/get_model_info", include_in_schema=False)
    async def model_info():
        return router_info.model_info(state.ready_engine())

    @app.get("/get_load")
    async def get_load():
        return [router_info.load(state.ready_engine())]

    @app.post("/v1/chat/completions", openapi_extra=_body_schema("ChatCompletionRequest"))
    async def chat_completions(request: Request):
        received_s = time.monotonic()
        engine = state.ready_engine()
        state.metrics.requests.labels("chat").inc()
        req = protocol.parse_request(protocol.ChatCompletionRequest, await _read_json(request, state.config))
        state.check_model(req.model)
        sources: list[ImageSource] = []
        messages = protocol.chat_messages(req, sources, _image_marker(engine))
        images = await _prepare_images(state, engine, sources)
        prompt_ids, boundaries = await asyncio.to_thread(_chat_ids, engine, messages, req.add_generation_prompt,
                                                         protocol.chat_template_kwargs(req))
        settings, grammar = _openai_chat_output(state, engine, req, prompt_ids)
        gen = _submit(state, engine, [prompt_ids], req, received_s, grammar, images=images, boundaries=boundaries)
        meta = protocol.ResponseMeta(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.served_name())
        token_bytes = engine.tokenizer.token_bytes
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            parsers = [ChatOutputParser(settings) for _ in gen.streams]
            return EventStream(chat_events(gen, meta, include_usage, token_bytes, parsers), gen)
        await _collect(request, gen, state)
        results = gen.results()
        for result in results:
            result.reasoning, result.text, result.tool_calls = parse_whole(settings, result.text)
        return protocol.chat_completion(meta, results, gen.usage(), token_bytes)

    @app.post("/v1/messages")
    async def messages(request: Request):
        received_s = time.monotonic()
        engine = state.ready_engine()
        state.metrics.requests.labels("messages").inc()
        req = anthropic.parse(anthropic.MessagesRequest, await _read_json(request, state.config))
        state.check_model(req.model)
        sources: list[ImageSource] = []
        chat = anthropic.to_chat(req, sources, _image_marker(engine))
        images = await _prepare_images(state, engine, sources)
        prompt_ids, boundaries = await asyncio.to_thread(_chat_ids, engine, chat.messages, True,
                                                         chat.template_kwargs)
        try:
            settings, grammar = chat_output(state.config, engine.tokenizer, prompt_ids, tools=chat.tools,
                                            tool_choice=chat.tool_choice, forced_name=chat.forced_name,
                                            parallel=chat.parallel)
        except OutputRequestError as e:
            raise ApiError(400, e.message, param=e.param) from None
        gen = _submit(state, engine, [prompt_ids], req, received_s, params=anthropic.sampling_params(req, grammar),
                      images=images, boundaries=boundaries)
        msg_id, model = f"msg_{uuid.uuid4().hex}", state.served_name()

        def finish_info() -> tuple[str | None, bool, str]:
            ids = gen.token_ids[0]
            return (gen.finish_reasons[0], bool(ids) and ids[-1] in engine.eos_token_ids,
                    engine.tokenizer.decode(ids[-STOP_TAIL_TOKENS:]))

        if req.stream:
            outputs = (out async for _, out in gen.events())
            return EventStream(anthropic.stream_events(outputs, ChatOutputParser(settings), msg_id, model,
                                                       gen.prompt_len(0), finish_info, req), gen)
        await _collect(request, gen, state)
        reasoning, text, calls = parse_whole(settings, gen.results()[0].text)
        finish, eos, tail = finish_info()
        stop = anthropic.matched_stop(req, finish, eos, tail)
        return anthropic.message_body(msg_id, model, reasoning, text, calls,
                                      anthropic.stop_reason(finish, bool(calls), stop), stop, gen.prompt_len(0),
                                      gen.usage().completion_tokens, gen.cached_tokens[0])

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        engine = state.ready_engine()
        req = anthropic.parse(anthropic.CountTokensRequest, await _read_json(request, state.config))
        state.check_model(req.model)
        chat = anthropic.to_chat(req)
        ids = await asyncio.to_thread(_encode_chat, engine, chat.messages, True, chat.template_kwargs)
        return {"input_tokens": len(ids)}

    @app.post("/tokenize", openapi_extra=_body_schema("TokenizeRequest"))
    async def tokenize(request: Request):
        engine = state.ready_engine()
        req = protocol.parse_request(protocol.TokenizeRequest, await _read_json(request, state.config))
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
        if req.prompt is not None:
            ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt, req.add_special_tokens)
        else:
            ids = await asyncio.to_thread(_encode_chat, engine, protocol.chat_messages(req),
                                          req.add_generation_prompt, protocol.chat_template_kwargs(req))
        return {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids}

    @app.post("/detokenize", openapi_extra=_body_schema("DetokenizeRequest"))
    async def detokenize(request: Request):
        engine = state.ready_engine()
        req = protocol.parse_request(protocol.DetokenizeRequest, await _read_json(request, state.config))
        state.check_model(req.model)
        bad = next((t for t in req.tokens if t >= engine.tokenizer.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"tokens: token id {bad} is outside the vocabulary "
                                f"(0..{engine.tokenizer.vocab_size - 1})", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions", openapi_extra=_body_schema("CompletionRequest"))
    async def completions(request: Request):
        received_s = time.monotonic()
        engine = state.ready_engine()
        state.metrics.requests.labels("completions").inc()
        req = protocol.parse_request(protocol.CompletionRequest, await _read_json(request, state.config))
        state.check_model(req.model)
        prompts = await asyncio.to_thread(_completion_prompts, engine, req.prompt)
        gen = _submit(state, engine, prompts, req, received_s)
        meta = protocol.ResponseMeta(f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.served_name())
        echoes = [_echo_text(engine, req.prompt, prompts, p) if req.echo else "" for p in gen.choice_prompt]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(completion_events(gen, meta, include_usage, echoes), gen)
        await _collect(request, gen, state)
        return protocol.completion(meta, gen.results(), gen.usage(), echoes)


def _body_schema(name: str) -> dict:
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _use_request_schemas(app: FastAPI) -> None:
    """The routes read their bodies themselves (with a size limit); document them anyway."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(protocol.request_body_schemas())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


async def _read_json(request: Request, config: EngineConfig):
    """The body as JSON (RequestGuard checked its content type), refused with 413 as soon as it passes the limit."""
    limit = config.max_body_bytes
    declared = request.headers.get("content-length", "")
    too_large = f"request body is larger than the limit of {limit} bytes (--max-body-bytes)"
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"{too_large}: Content-Length is {declared}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, too_large, code="request_too_large")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise ApiError(400, "request body is empty: send a JSON object")
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    _refuse_lone_surrogates(value)
    return value


def _refuse_lone_surrogates(body) -> None:
    """JSON's \\uD800-\\uDFFF escapes decode to lone surrogates when unpaired: no text can hold them, so name where.

    The common case costs one C-speed encode; only a body that fails it is walked (with a stack: bodies nest deep)."""
    try:
        json.dumps(body, ensure_ascii=False).encode()
        return
    except UnicodeEncodeError:
        pass
    stack = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            bad = _SURROGATE.search(value)
            if bad is not None:
                raise ApiError(400, f"{path or 'request body'}: character {bad.start()} is a lone UTF-16 surrogate "
                                    f"(\\u{ord(bad.group()):04x} without its pair): send valid Unicode text",
                               param=path or None)
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.extend([(key, f"{path} (a key)"), (item, f"{path}.{key}" if path else key)])


def _prompt_texts(prompt) -> list[str]:
    return [prompt] if isinstance(prompt, str) else list(prompt)


def _echo_text(engine: Engine, prompt, prompts: list[list[int]], p: int) -> str:
    """The text of prompt p, as the client sent it (or decoded, when it sent token ids)."""
    return _prompt_texts(prompt)[p] if _is_text(prompt) else engine.tokenizer.decode(prompts[p])


def _is_text(prompt) -> bool:
    return isinstance(prompt, str) or isinstance(prompt[0], str)


def _completion_prompts(engine: Engine, prompt) -> list[list[int]]:
    """Token ids of each prompt (a string, strings, token ids, or lists of token ids)."""
    tok = engine.tokenizer
    if _is_text(prompt):
        prompts = [tok.encode(text) for text in _prompt_texts(prompt)]
    else:
        prompts = [prompt] if isinstance(prompt[0], int) else prompt
        for p, ids in enumerate(prompts):
            bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"prompt[{p}]: token id {bad} is outside the vocabulary (0..{tok.vocab_size - 1})",
                               param="prompt")
    for p, ids in enumerate(prompts):
        if not ids:
            raise ApiError(400, f"prompt[{p}] is empty (0 tokens): send at least one token", param="prompt")
    return prompts


def _encode_chat(engine: Engine, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> list[int]:
    """The chat's prompt ids; a template that refuses the client's data is a 400 naming `messages`."""
    return _chat_ids(engine, messages, add_generation_prompt, kwargs, with_boundaries=False)[0]


def _chat_ids(engine: Engine, messages: list[dict], add_generation_prompt: bool, kwargs: dict,
              with_boundaries: bool = True) -> tuple[list[int], list[int]]:
    """(the chat's prompt ids, where its messages end: the prefix cache keeps checkpoints there)."""
    try:
        return engine.tokenizer.encode_chat_boundaries(
            messages, add_generation_prompt, with_boundaries=with_boundaries and engine.prefix_cache is not None,
            **kwargs)
    except ChatTemplateError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    except Exception as e:  # the template ran on the client's data (messages, tools, chat_template_kwargs)
        raise ApiError(400, f"messages: the chat template failed on this request: {type(e).__name__}: {e}",
                       param="messages") from None


def _openai_chat_output(state: ServerState, engine: Engine, req, prompt_ids: list[int]):
    """The output settings and grammar of an OpenAI chat request (tool_choice, response_format)."""
    forced = protocol.forced_tool(req)
    choice = forced[0] if forced else (req.tool_choice or "auto")
    try:
        return chat_output(state.config, engine.tokenizer, prompt_ids, tools=req.tools, tool_choice=choice,
                           forced_name=forced[1] if forced else None,
                           response_schema=protocol.response_format_schema(req),
                           parallel=req.parallel_tool_calls is not False)
    except OutputRequestError as e:
        raise ApiError(400, e.message, param=e.param) from None


def _image_marker(engine: Engine) -> str:
    """The text the chat template's image placeholder is: vision_start, the image token, vision_end."""
    if not engine.accepts_images:
        return ""
    config = engine.loaded.config
    ids = [config.get("vision_start_token_id"), engine.image_token_id, config.get("vision_end_token_id")]
    return engine.tokenizer.decode([i for i in ids if i is not None], skip_special_tokens=False)


async def _prepare_images(state: ServerState, engine: Engine, sources: list[ImageSource]) -> list[PreparedImage]:
    """Read and preprocess a request's images (in the thread pool); any problem is a 400 naming the image."""
    if not sources:
        return []
    if not engine.accepts_images:
        raise ApiError(400, f"{sources[0].where}: {engine.images_refusal()}", param=sources[0].where,
                       code="images_not_supported")
    limits = engine.image_limits
    if len(sources) > limits.max_images:
        raise ApiError(400, f"{len(sources)} images in one request, over the limit of {limits.max_images} "
                            f"(--max-images-per-request)", param="messages", code="too_many_images")

    def prepare(source: ImageSource) -> PreparedImage:
        data = read_source(source, limits, state.config.allowed_local_media_path)
        return preprocess(data, limits, engine.image_settings)

    prepared = []
    for source in sources:
        try:
            prepared.append(await asyncio.to_thread(prepare, source))
        except ImageError as e:
            raise ApiError(400, f"{source.where}: {e}", param=source.where, code="invalid_image") from None
    return prepared


def _submit(state: ServerState, engine: Engine, prompts: list[list[int]], req, received_s: float,
            grammar: str | None = None, params: SamplingParams | None = None,
            images: list[PreparedImage] | None = None, boundaries: list[int] = ()) -> Generation:
    """One engine request per (prompt, choice); refused as a whole if any part is refused.

    `params` (one choice) replaces the OpenAI request's own sampling fields (the Anthropic route); `boundaries`
    (a chat's one prompt) are where its messages end."""
    choices = 1 if params is not None else req.n  # per prompt
    total = len(prompts) * choices
    if total > protocol.MAX_CHOICES:
        raise ApiError(400, f"n × prompts = {choices} × {len(prompts)} exceeds the limit of {protocol.MAX_CHOICES} "
                            f"choices per request", param="n")
    shortest = min(len(p) for p in prompts)
    max_new = params.max_tokens if params is not None else protocol.max_new_tokens(req)
    if total > 1 and engine.scheduler.policy.refusal(shortest, max_new) is None:
        most = engine.most_requests_at_once(shortest, max_new)
        if total > most:  # its own copies would fill the queue: 429 forever, so say it can never run as sent
            raise ApiError(400, f"n × prompts = {choices} × {len(prompts)} = {total} choices, but this server holds "
                                f"at most {most} requests of this size at once (running beside each other, plus "
                                f"--max-queue {engine.config.max_queue} waiting): lower n or max_tokens", param="n")
    vocab = engine.vocab_size  # the width of the logits the biases index
    outside = [key for key in (getattr(req, "logit_bias", None) or {})
               if key.isascii() and key.isdigit() and (len(key) > 18 or int(key) >= vocab)]
    if outside:
        raise ApiError(400, f"logit_bias: token id {outside[0]} is outside the vocabulary (0..{vocab - 1})",
                       param="logit_bias")
    if state.drain.cut:  # admitted before the drain, but reached the engine after its deadline
        raise ApiError(503, REFUSED, code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
    base_id = uuid.uuid4().hex
    streams: list[RequestStream] = []
    choice_prompt = []
    try:
        for p, prompt_ids in enumerate(prompts):
            for j in range(choices):
                choice_params = params or protocol.sampling_params(req, j, grammar)
                streams.append(engine.submit(prompt_ids, choice_params, request_id=f"{base_id}-{len(streams)}",
                                             images=images, boundaries=tuple(boundaries)))
                choice_prompt.append(p)
    except RequestRefused as e:
        _abort_all(engine, streams)
        raise ApiError(e.status, e.message, param="messages" if hasattr(req, "messages") else "prompt",
                       code=e.reason) from None
    except QueueFull as e:
        _abort_all(engine, streams)
        retry_s = max(1, math.ceil(e.retry_after_s))
        raise ApiError(429, f"the server is busy: {e.message}", code="queue_full",
                       headers={"Retry-After": str(retry_s)}) from None
    except protocol.ProtocolError:
        _abort_all(engine, streams)
        raise
    except ValueError as e:  # SamplingParams' own checks
        _abort_all(engine, streams)
        raise ApiError(400, str(e)) from None
    gen = Generation(engine, state.metrics, prompts, choice_prompt, streams, received_s, state.log)
    state.drain.track(gen)
    return gen


def _abort_all(engine: Engine, streams: list[RequestStream]) -> None:
    for stream in streams:
        engine.abort(stream.request_id)


async def _collect(request: Request, gen: Generation, state: ServerState) -> None:
    """Read every output of a non-streamed request, aborting it if the client leaves meanwhile."""

    async def drain() -> None:
        async for _ in gen.events():
            pass

    task = asyncio.create_task(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                state.metrics.disconnects.inc()
                raise ClientDisconnect()
        task.result()
    except GenerationFailed as e:
        raise ApiError(e.status, e.message, code=e.code) from None
    finally:
        task.cancel()
        gen.close()
