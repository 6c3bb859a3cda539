"""What every route shares: the server's state (settings, metrics, the drain, the engine once it has loaded), ApiError
(an error response, which app.py's handlers shape per API), and reading a request body.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from deltaserve.config import EngineConfig
from deltaserve.engine.door import Refused
from deltaserve.engine.engine import Engine
from deltaserve.server.drain import Drain
from deltaserve.server.metrics import ServerMetrics

ANTHROPIC_PATH = "/v1/messages"  # requests under it are answered in Anthropic's error shape
LOADING_RETRY_AFTER_S = 5
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    """An error response: status, one-line message, and the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def refused_error(refused: Refused) -> ApiError:
    """The engine's refusal (engine/door.py) as a response; a full queue says when to come back (Retry-After)."""
    headers = None
    if refused.retry_after_s is not None:
        headers = {"Retry-After": str(max(1, math.ceil(refused.retry_after_s)))}
    return ApiError(refused.status, refused.message, param=refused.param, code=refused.code, headers=headers)


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
        return self.config.served_model_name or self.engine.info.model_name

    def check_model(self, name: str | None) -> None:
        """A request may name the served name, the engine's own name or the --model path (or none)."""
        accepted = {self.served_name(), self.engine.info.model_name, self.config.model}
        if name is not None and name not in accepted:
            raise ApiError(404, f"model {name!r} does not exist: this server serves {self.served_name()!r}",
                           param="model", code="model_not_found")


async def receive(state: ServerState, request: Request, route: str, parse: Callable, model: type):
    """What a generation route does first: (when it arrived, the engine, the request). The engine is taken (503 while
    loading), the request counted under `route`, the body read and validated as `parse(model, body)`, and the model
    it names checked."""
    received_s = time.monotonic()
    engine = state.ready_engine()
    state.metrics.requests.labels(route).inc()
    req = parse(model, await read_json(request, state.config))
    state.check_model(req.model)
    return received_s, engine, req


async def read_json(request: Request, config: EngineConfig):
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
