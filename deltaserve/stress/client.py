"""Talking to the server under test: request bodies, streamed generation requests, usage probes.

Everything here is one bounded HTTP exchange; loops live in runner.py, health probes in health.py.
"""

import asyncio
import ipaddress
import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

ERROR_TEXT_CHARS = 160  # enough for "prompt 14000 + 32000 reserved > pool 67375"; a stack trace is cut
ERROR_BODY_BYTES = 4096
CONNECT_TIMEOUT_S = 10.0
LOOPBACK_NAMES = ("localhost",)
# Request fields that make a server generate max_tokens even past EOS: SGLang, llama.cpp and ours read
# ignore_eos, vLLM reads both.
FORCE_FIELDS = ("ignore_eos", "min_tokens")


@dataclass(frozen=True)
class Target:
    """The server under test: where it answers and what to ask it for."""

    root_url: str  # http://127.0.0.1:8000 (health, metrics)
    api_url: str  # http://127.0.0.1:8000/v1
    model: str | None
    endpoint: str  # "chat" | "completions"
    api_key: str | None = None

    @property
    def generate_url(self) -> str:
        return f"{self.api_url}/chat/completions" if self.endpoint == "chat" else f"{self.api_url}/completions"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestResult:
    """What one streamed request did; times in seconds from the request being sent."""

    index: int
    kind: str  # "ok" | "refused" (429) | "http" (other status) | "stream" (error event) | "transport" | "timeout"
    status: int | None = None
    error: str | None = None
    sent_at: float = 0.0  # monotonic clock
    ttft_s: float | None = None
    e2e_s: float | None = None
    last_token_s: float | None = None
    prompt_tokens: int | None = None  # as the server reported in usage
    completion_tokens: int | None = None  # from usage, else counted text chunks
    speculative: dict | None = None  # usage.speculative {drafted, accepted}, from a server that speculates
    text_chunks: int = 0
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def failure(self) -> str:
        """A grouping key for the report: kind, status and error text."""
        if self.kind == "refused":
            return f"HTTP 429 (queue full): {self.error}"
        if self.status is not None:
            return f"HTTP {self.status}: {self.error}"
        return f"{self.kind}: {self.error}"


class TargetError(ValueError):
    """The target cannot be stressed: bad URL, not local, not answering, refusing the probe."""


def parse_target_url(url: str, allow_remote: bool) -> tuple[str, str]:
    """(root_url, api_url) from a base URL with or without /v1; TargetError when it is not a local http URL."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TargetError(f"--url: {url!r} is not an http(s) URL like http://127.0.0.1:8000")
    if not allow_remote and not is_loopback(parts.hostname):
        raise TargetError(f"--url: {parts.hostname} is not this machine; stress only servers you own "
                          f"(pass --allow-remote to stress it anyway)")
    path = parts.path.rstrip("/")
    root_path = path[:-3] if path.endswith("/v1") else path
    root = f"{parts.scheme}://{parts.netloc}{root_path}"
    return root, f"{root}/v1"


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def http_client(max_connections: int, request_timeout_s: float) -> httpx.AsyncClient:
    """One client for the run; proxies from the environment are ignored (the target is local)."""
    timeout = httpx.Timeout(request_timeout_s, connect=CONNECT_TIMEOUT_S)
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


def generation_body(target: Target, prompt: str, max_tokens: int, *, stream: bool,
                    force_fields: tuple[str, ...] = ()) -> dict:
    """The JSON body of one request; `force_fields` (of FORCE_FIELDS) ask the server for all `max_tokens`."""
    body: dict = {"max_tokens": max_tokens, "stream": stream}
    if target.model:
        body["model"] = target.model
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    if "ignore_eos" in force_fields:
        body["ignore_eos"] = True
    if "min_tokens" in force_fields:
        body["min_tokens"] = max_tokens
    return body


def error_text(body: bytes) -> str:
    """The message of an OpenAI-style error body, else its first characters, on one line."""
    text = body[:ERROR_BODY_BYTES].decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        text = err if isinstance(err, str) else json.dumps(err)
    return shorten(text)


def shorten(text: str) -> str:
    """One line, at most ERROR_TEXT_CHARS characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= ERROR_TEXT_CHARS else line[:ERROR_TEXT_CHARS - 3] + "..."


def transport_error_text(exc: BaseException) -> str:
    """What a transport failure means for the server, in words."""
    if isinstance(exc, httpx.ConnectError):
        return "connection refused (server not listening)"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "server closed the connection mid-response"
    if isinstance(exc, httpx.ReadError | httpx.WriteError):
        return "connection reset"
    return shorten(f"{type(exc).__name__}: {exc}") if str(exc) else type(exc).__name__


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line, else None (comments, event names, blank lines)."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def chunk_text(chunk: dict) -> tuple[str, str | None]:
    """(generated text, finish_reason) of one streamed chat or completions chunk."""
    text, finish = "", None
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        text += choice.get("text") or ""
        finish = choice.get("finish_reason") or finish
    return text, finish


async def stream_generation(client: httpx.AsyncClient, target: Target, body: dict, index: int,
                            deadline: float) -> RequestResult:
    """Send one streamed request and time it; never raises (every outcome is a RequestResult).

    `deadline` is a monotonic time: the request is abandoned then and counted as a timeout.
    """
    result = RequestResult(index=index, kind="ok", sent_at=time.monotonic())
    done = False
    try:
        async with asyncio.timeout_at(_loop_time(deadline)):
            async with client.stream("POST", target.generate_url, json=body, headers=target.headers) as response:
                result.status = response.status_code
                if response.status_code != 200:
                    message = error_text(await response.aread())
                    result.kind = "refused" if response.status_code == 429 else "http"
                    result.error = message
                    return result
                result.status = None
                async for line in response.aiter_lines():
                    data = sse_data(line)
                    if data is None:
                        continue
                    if data == "[DONE]":
                        done = True
                        break
                    _take_chunk(result, json.loads(data))
                    if result.kind != "ok":
                        return result
    except TimeoutError:
        result.kind, result.error = "timeout", "cell duration limit reached before the response ended"
    except json.JSONDecodeError as e:
        result.kind, result.error = "stream", shorten(f"a streamed event is not JSON: {e}")
    except httpx.TimeoutException:
        result.kind, result.error = "timeout", "request timeout (no bytes from the server for too long)"
    except httpx.TransportError as e:
        result.kind, result.error = "transport", transport_error_text(e)
    finally:
        result.e2e_s = time.monotonic() - result.sent_at
    if result.kind == "ok" and not done and result.finish_reason is None:
        result.kind, result.error = "stream", "stream ended without a finish reason or [DONE]"
    if result.kind == "ok" and result.completion_tokens is None:
        result.completion_tokens = result.text_chunks
    return result


def _take_chunk(result: RequestResult, chunk: dict) -> None:
    """Fold one streamed event into `result`: first-token time, last-token time, usage, errors."""
    if "error" in chunk and not chunk.get("choices"):
        err = chunk["error"]
        result.kind = "stream"
        result.error = shorten(err.get("message", err) if isinstance(err, dict) else err)
        return
    text, finish = chunk_text(chunk)
    now = time.monotonic() - result.sent_at
    if text:
        result.text_chunks += 1
        result.last_token_s = now
        if result.ttft_s is None:
            result.ttft_s = now
    result.finish_reason = finish or result.finish_reason
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)
        if isinstance(usage.get("speculative"), dict):
            result.speculative = usage["speculative"]


def _loop_time(monotonic_deadline: float) -> float:
    """asyncio's clock is time.monotonic on every platform we run on; convert defensively anyway."""
    return asyncio.get_running_loop().time() + (monotonic_deadline - time.monotonic())


async def usage_probe(client: httpx.AsyncClient, target: Target, prompt: str, *,
                      force_fields: tuple[str, ...] = (), max_tokens: int = 1) -> dict:
    """A tiny non-streamed request; its JSON (usage, choices). TargetError with the server's message on failure."""
    body = generation_body(target, prompt, max_tokens, stream=False, force_fields=force_fields)
    try:
        response = await client.post(target.generate_url, json=body, headers=target.headers)
    except httpx.TransportError as e:
        raise TargetError(f"{target.generate_url}: {transport_error_text(e)}") from None
    if response.status_code != 200:
        raise TargetError(f"{target.generate_url} refused a {max_tokens}-token probe: "
                          f"HTTP {response.status_code}: {error_text(response.content)}")
    data = response.json()
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
        raise TargetError(f"{target.generate_url} reports no usage.prompt_tokens, so prompt sizes cannot be "
                          f"calibrated; give --tokenizer PATH")
    return data
