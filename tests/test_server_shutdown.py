"""SIGTERM on a real `deltaserve serve` (the tiny hybrid): a drain, not a cut. New requests get 503 with Retry-After in
the caller's error shape and /health says "draining"; requests already running finish intact within
--shutdown-timeout; past it, open streams end with an error event (OpenAI: then `data: [DONE]`; Anthropic: `event:
error`) and non-streamed requests get a 503 JSON; the process exits 0. Driven by real signals, the openai and
anthropic packages, httpx and a raw socket.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from server_util import assert_openai_error, running_server
from test_engine_support import make_hybrid_checkpoint

TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "qwen3.jinja"
PROMPT = "t5 t17 t33 t2 t90 t41"
LONG_TOKENS = 3000  # tiny hybrid: seconds of decoding here, long after the drain begins (300 once ended first)
ENDLESS_TOKENS = 3000  # far longer than the short timeout below: these are cut
WAIT_S = 120  # upper bound of every wait below (a busy machine); nothing asserts on time
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shutdown-hybrid")
    make_hybrid_checkpoint(folder)
    return folder


def start(tmp_path: Path, model: Path, timeout_s: float):
    return running_server(tmp_path, "--model", str(model), "--chat-template", str(TEMPLATE), "--max-total-tokens",
                          "16384", "--max-running-requests", "8", "--served-model-name", "hyb",
                          "--shutdown-timeout", str(timeout_s))


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=WAIT_S,
                         http_client=httpx.Client(trust_env=False))


def until(condition, what: str):
    """Poll `condition` until it returns something true (a generous bound, for a busy machine)."""
    give_up = time.monotonic() + WAIT_S
    while time.monotonic() < give_up:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def health_status(server) -> int:
    try:
        return server.get("/health", timeout=10).status_code
    except httpx.TransportError:
        return 0


def exit_code(server) -> int:
    return server.process.wait(timeout=WAIT_S)


class StreamReader(threading.Thread):
    """Reads one OpenAI completions stream through the openai package: its text, or the exception it raised."""

    def __init__(self, server, max_tokens: int):
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.pieces: list[str] = []
        self.finish: str | None = None
        self.error: Exception | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            stream = client(self.server).completions.create(model=None, prompt=PROMPT, max_tokens=self.max_tokens,
                                                             stream=True, **GREEDY)
            for chunk in stream:
                self.started.set()
                self.pieces.append(chunk.choices[0].text)
                self.finish = chunk.choices[0].finish_reason or self.finish
        except Exception as e:
            self.error = e
        finally:
            self.started.set()


def slow_upload(server) -> tuple[socket.socket, bytes]:
    """A POST whose headers are complete and whose body has half arrived: a request admitted and still running."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=WAIT_S)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    sock.sendall(head + body[:10])
    return sock, body[10:]


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_drain_refuses_newcomers_and_lets_running_requests_finish(tmp_path, model):
    with start(tmp_path, model, timeout_s=WAIT_S) as server:
        alone = StreamReader(server, LONG_TOKENS)
        alone.run()
        assert alone.error is None and alone.finish == "length", alone.error

        stream = StreamReader(server, LONG_TOKENS)
        stream.start()
        assert stream.started.wait(WAIT_S)
        holder, rest_of_body = slow_upload(server)
        until(lambda: server.metric("deltaserve_requests_running") >= 1, "the stream runs in the engine")

        server.process.send_signal(signal.SIGTERM)
        until(lambda: health_status(server) == 503, "/health answers 503")
        health = server.get("/health")
        assert health.headers["retry-after"] and health.json()["error"]["code"] == "draining", health.text
        # /metrics stays open while draining: the stream is still running after the signal
        assert server.metric("deltaserve_requests_running") == 1

        refused = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert_openai_error(refused, 503, "shutting down")
        assert int(refused.headers["retry-after"]) > 0
        with pytest.raises(openai.APIStatusError) as caught:
            client(server).chat.completions.create(model=None, messages=[{"role": "user", "content": "t1"}])
        assert caught.value.status_code == 503 and "shutting down" in caught.value.message
        messages = server.post("/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": "t1"}]})
        assert messages.status_code == 503 and messages.headers["retry-after"]
        assert messages.json()["type"] == "error" and "shutting down" in messages.json()["error"]["message"]

        holder.sendall(rest_of_body)  # admitted before the signal: it runs to the end like the stream
        status, body = read_response(holder)
        assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length", body
        stream.join(WAIT_S)
        assert stream.error is None, stream.error
        assert stream.finish == "length" and "".join(stream.pieces) == "".join(alone.pieces)
        assert exit_code(server) == 0, server.log_tail()
        assert "ending" not in server.log_tail()  # nothing was cut


def sse_lines(server, path: str, body: dict, started: threading.Event, out: list[str]) -> None:
    with httpx.stream("POST", server.url + path, json=body, timeout=WAIT_S, trust_env=False) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                out.append(line)
                started.set()


def test_past_the_timeout_every_open_request_ends_in_words(tmp_path, model):
    with start(tmp_path, model, timeout_s=1) as server:
        raw_started, raw_lines = threading.Event(), []
        raw = threading.Thread(target=sse_lines, daemon=True, args=(server, "/v1/completions", {
            "prompt": PROMPT, "max_tokens": ENDLESS_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True},
            raw_started, raw_lines))
        raw.start()
        sdk_stream = StreamReader(server, ENDLESS_TOKENS)
        sdk_stream.start()

        claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=WAIT_S)
        claude_result: dict = {}
        claude_started = threading.Event()

        def claude_stream() -> None:
            try:
                with claude.messages.stream(model="hyb", max_tokens=ENDLESS_TOKENS, extra_body={"temperature": 0},
                                            messages=[{"role": "user", "content": PROMPT}]) as events:
                    for event in events:
                        if event.type == "content_block_delta":
                            claude_started.set()
            except Exception as e:
                claude_result["error"] = e
            finally:
                claude_started.set()

        claude_thread = threading.Thread(target=claude_stream, daemon=True)
        claude_thread.start()
        whole: dict = {}
        whole_thread = threading.Thread(target=lambda: whole.update(response=server.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": ENDLESS_TOKENS, "temperature": 0, "ignore_eos": True}, timeout=WAIT_S)),
            daemon=True)
        whole_thread.start()
        for event in (raw_started, sdk_stream.started, claude_started):
            assert event.wait(WAIT_S)
        assert sdk_stream.error is None and not claude_result, (sdk_stream.error, claude_result)
        until(lambda: server.metric("deltaserve_requests_running") == 4, "all four requests run")

        server.process.send_signal(signal.SIGTERM)
        for thread in (raw, sdk_stream, claude_thread, whole_thread):
            thread.join(WAIT_S)
            assert not thread.is_alive()

        # the raw OpenAI stream: tokens, then one error event naming the timeout, then [DONE]
        assert raw_lines[-1] == "data: [DONE]", raw_lines[-3:]
        error = json.loads(raw_lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "shutting_down" and "--shutdown-timeout 1 s" in error["message"], error
        assert all('"finish_reason":"length"' not in line for line in raw_lines)
        # the openai package raises a clean APIError with the server's words
        assert isinstance(sdk_stream.error, openai.APIError), repr(sdk_stream.error)
        assert "shutting down" in sdk_stream.error.message and sdk_stream.pieces
        # the anthropic package reads the `event: error`
        assert isinstance(claude_result.get("error"), anthropic.APIStatusError), claude_result
        assert claude_result["error"].body["error"]["type"] == "overloaded_error"
        assert "shutting down" in claude_result["error"].body["error"]["message"]
        # the non-streamed request: a 503 JSON in OpenAI's shape
        assert_openai_error(whole["response"], 503, "shutting down", "--shutdown-timeout")
        assert exit_code(server) == 0, server.log_tail()
        assert "ending 4 unfinished requests" in server.log_tail()
