"""uvicorn's h11 protocol with the two limits it lacks: a deadline for a request's headers, and a connection cap.

uvicorn's `limit_concurrency` only answers 503 once a request's headers are complete, and h11 has no header timeout,
so 300 clients sending headers byte by byte were all held open. Here a connection that has not completed a request's
headers `header_timeout_s` after it opened (or after its previous response) gets 408 and is closed, and a connection
beyond `max_connections` gets 503 at once and is closed.
"""

from __future__ import annotations

import asyncio
import functools
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from deltaserve.server import protocol

RETRY_AFTER_S = 1
REFUSED_LINGER_S = 1.0  # a refused connection is read (and ignored) this long, so its 503 arrives intact


def _raw_error(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    """A complete HTTP/1.1 error response in OpenAI's shape, written before any request was parsed."""
    body = json.dumps(protocol.error_body(message, protocol.error_type(status), None, code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra}\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """H11Protocol plus a header deadline and a connection cap (see the module docstring)."""

    def __init__(self, *args, header_timeout_s: float, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections
        self._header_deadline: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse(_raw_error(503, "Service Unavailable", f"too many open connections (limit "
                                    f"{self.max_connections}, --max-connections): retry shortly",
                                    "too_many_connections", f"retry-after: {RETRY_AFTER_S}\r\n"))
            return
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        # The cycle in progress now: a new request's headers replace it, which is what the deadline waits for.
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late, self.cycle)

    def _headers_late(self, cycle_when_armed) -> None:
        if self.cycle is not cycle_when_armed or self.transport.is_closing():
            return  # the headers came in time
        self._refuse(_raw_error(408, "Request Timeout", f"the request headers did not arrive within "
                                f"{self.header_timeout_s:g} s (--header-timeout-s)", "request_timeout"))

    def _refuse(self, response: bytes) -> None:
        """Send `response`, half-close, and read (ignoring it) a while before closing: closing with the client's
        bytes unread would reset the connection (RST) and could destroy the answer before the client reads it."""
        self._refused = True
        self.transport.write(response)
        self.transport.write_eof()
        self.loop.call_later(REFUSED_LINGER_S, self.transport.close)


def protocol_class(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """The class to pass as uvicorn's `http`: GuardedH11Protocol with these limits bound."""
    return functools.partial(GuardedH11Protocol, header_timeout_s=header_timeout_s,  # type: ignore[return-value]
                             max_connections=max_connections)
