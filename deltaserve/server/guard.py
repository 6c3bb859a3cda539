"""The checks every HTTP request passes before any route: Host (DNS rebinding), API key, JSON content type.

One pure ASGI middleware, so /metrics, /docs, /openapi.json and any route added later are covered without each
route opting in, and streamed responses pass through untouched (starlette's BaseHTTPMiddleware would buffer them).
A browser page can reach 127.0.0.1: a `text/plain` form POST needs no CORS preflight (CSRF), and a rebound DNS
name reaches a loopback server with a foreign Host header; both are refused here.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Callable

from deltaserve.server import protocol

LIVENESS_PATH = "/health"  # the one route open without the key: load balancers and `curl` probes
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
JSON_MEDIA_TYPE = "application/json"


def is_loopback(host: str) -> bool:
    """Whether a listen address only accepts local connections (where Host checks stop DNS rebinding)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The Host header without its port, lower-case: '[::1]:8000' -> '[::1]', 'LocalHost:80' -> 'localhost'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[: header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequestGuard:
    """ASGI middleware refusing, in OpenAI's error shape: a foreign Host (403), a missing or wrong key (401), a POST
    body that is not application/json (415). `on_error(status)` counts each refusal."""

    def __init__(self, app, *, api_key: str | None, allowed_hosts: tuple[str, ...] | None,
                 on_error: Callable[[int, str], None] = lambda status, type_: None):
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.allowed_hosts = None if allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts)
        self.on_error = on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is None:
            return await self.app(scope, receive, send)
        status, message, code, extra = refusal
        type_ = protocol.error_type(status)
        self.on_error(status, type_)
        body = json.dumps(protocol.error_body(message, type_, None, code)).encode()
        response_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *((k.encode(), v.encode()) for k, v in extra.items())]
        await send({"type": "http.response.start", "status": status, "headers": response_headers})
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, scope, headers: dict[str, str]) -> tuple[int, str, str, dict[str, str]] | None:
        if self.allowed_hosts is not None:
            name = host_name(headers.get("host", ""))
            if name not in self.allowed_hosts:
                return (403, f"Host header {headers.get('host', '')!r} is not allowed: this server is bound to a "
                             f"loopback address and answers only Host {', '.join(sorted(self.allowed_hosts))} "
                             f"(add more with --allowed-hosts)", "host_not_allowed", {})
        if self.api_key is not None and scope["path"] != LIVENESS_PATH and scope["method"] != "OPTIONS":
            problem = self._key_problem(headers)
            if problem is not None:
                return 401, problem, "invalid_api_key", {"WWW-Authenticate": "Bearer"}
        if scope["method"] in ("POST", "PUT", "PATCH"):
            media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media_type != JSON_MEDIA_TYPE:
                got = headers.get("content-type")
                return (415, f"Content-Type must be {JSON_MEDIA_TYPE} (optionally with a charset), got "
                             f"{got!r}" if got else f"Content-Type is missing: send {JSON_MEDIA_TYPE}",
                        "unsupported_media_type", {})
        return None

    def _key_problem(self, headers: dict[str, str]) -> str | None:
        """None when the key is right; compared in constant time so its length and prefix do not leak."""
        if "authorization" in headers:
            scheme, _, token = headers["authorization"].partition(" ")
            if scheme.lower() != "bearer":
                return "missing API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
        elif "x-api-key" in headers:
            token = headers["x-api-key"]
        else:
            return "missing API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
        if not hmac.compare_digest(token.strip().encode(), self.api_key):
            return "invalid API key"
        return None
