"""Shutdown that ends every request in words: stop admitting, let running requests finish, then cut what is left.

On SIGTERM or SIGINT (serve.py) the server drains. Every new request gets 503 with Retry-After (OpenAI's error
shape, Anthropic's on /v1/messages) and GET /health answers 503 "draining", so a router stops sending here; the
requests already admitted run on for up to --shutdown-timeout seconds. Whatever is still open then is cut: its
engine requests are aborted with a shutdown message, so a stream ends with an error event (and `data: [DONE]` on
the OpenAI routes) and a non-streamed request gets a 503 JSON, never a reset connection. Only then does uvicorn stop
listening and the process exit 0. uvicorn's own graceful shutdown closes the socket at once (a new client would get
"connection refused", not a 503) and cuts streams after its timeout without a word; so it runs only after the drain.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import Callable

from deltaserve.server import anthropic_wire, protocol

RETRY_AFTER_S = 5  # a client told to come back: by then a router sends it to another instance, or this one is back
CUT_GRACE_S = 5.0  # after the cut, how long the cut responses have to send their last event
POLL_S = 0.05
OPEN_WHILE_DRAINING = ("/metrics",)  # an operator watches the drain there
HEALTH_PATH = "/health"
REFUSED = "the server is shutting down and takes no new requests: retry on another instance or after it restarts"


class Drain:
    """The drain's state, shared by the gate (admission), the routes (what reached the engine) and serve.py."""

    def __init__(self, timeout_s: float, log: Callable[[str], None]):
        self.timeout_s, self.log = timeout_s, log
        self.draining = False  # new requests are refused
        self.cut = False  # the deadline passed: requests still open were ended
        self.active = 0  # admitted HTTP requests whose response has not ended: what the drain waits for
        self._generations: weakref.WeakSet = weakref.WeakSet()  # those that reached the engine
        self._hurry = False

    def track(self, generation) -> None:
        """A request that reached the engine: it is cut at the deadline if it has not finished by then."""
        self._generations.add(generation)

    def hurry(self) -> None:
        """Stop waiting for running requests (a second Ctrl-C): cut them now."""
        self._hurry = True

    async def run(self) -> None:
        """Refuse new requests, wait for the admitted ones up to the timeout, cut the rest and wait for their last
        event; returns when the server may stop."""
        self.draining = True
        self.log(f"deltaserve: shutting down: new requests get 503; {self.active} running requests have up to "
                 f"{self.timeout_s:g} s to finish (--shutdown-timeout)")
        await self._until_idle(self.timeout_s)
        if self.active:
            self.cut = True
            open_ = [g for g in list(self._generations) if not g.closed]
            self.log(f"deltaserve: shutdown timeout: ending {len(open_)} unfinished requests with an error")
            message = (f"the server is shutting down and this request did not finish within --shutdown-timeout "
                       f"{self.timeout_s:g} s: retry it on another instance or after the server restarts")
            for generation in open_:
                generation.cut(message)
            self._hurry = False
            await self._until_idle(CUT_GRACE_S)
        self.log("deltaserve: drained; stopping")

    async def _until_idle(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.active and not self._hurry and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)


class DrainGate:
    """ASGI middleware: counts the requests it admits (the drain waits for them) and, while the server drains,
    answers every new one with 503 and Retry-After instead (GET /health: "draining"), except /metrics."""

    def __init__(self, app, *, drain: Drain, anthropic_path: str,
                 on_error: Callable[[int, str], None] = lambda status, type_: None):
        self.app, self.drain, self.anthropic_path, self.on_error = app, drain, anthropic_path, on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.draining and scope["path"] not in OPEN_WHILE_DRAINING:
            return await self._refuse(scope["path"], send)
        self.drain.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.active -= 1

    async def _refuse(self, path: str, send) -> None:
        status = 503
        if path == HEALTH_PATH:
            body = protocol.error_body("draining: the server is shutting down; send requests elsewhere",
                                       protocol.error_type(status), None, "draining")
        elif path.startswith(self.anthropic_path):
            body = anthropic_wire.error_body(status, REFUSED)
        else:
            body = protocol.error_body(REFUSED, protocol.error_type(status), None, "shutting_down")
        self.on_error(status, protocol.error_type(status))
        data = json.dumps(body).encode()
        # connection: close, so a client's pool opens its next connection afresh (to another instance, behind a router)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                   (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
