"""A recording HTTP proxy for the coding-agent tests: the agents (opencode, Codex CLI, Claude Code) talk to the server
through it, and the test reads back every exchange and checks the answers with the SDKs' own types."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable

import httpx


class RecordingProxy:
    """A pass-through HTTP proxy on 127.0.0.1 in front of the server that keeps every exchange: method, path,
    request body (as relayed), status, response headers and response body. Responses are relayed chunk by chunk as they arrive
    (streams stay streams) and the connection is closed after each (HTTP/1.0).

    `rewrite(path, body)`, where given, may change a JSON request body on its way (the agent tests force a tool
    call with it); the exchange keeps the body as relayed, and the agent's own under `original`."""

    def __init__(self, upstream: str, rewrite: Callable[[str, dict], dict] | None = None):
        self.exchanges: list[dict] = []
        proxy = self

        class Relay(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def relay(self):
                original = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = original
                if rewrite is not None and original:
                    body = json.dumps(rewrite(self.path, json.loads(original))).encode()
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "connection", "content-length")}
                record = {"method": self.command, "path": self.path, "request": body, "original": original,
                          "status": None, "response": b""}
                proxy.exchanges.append(record)
                with httpx.stream(self.command, upstream + self.path, content=body, headers=headers,
                                  timeout=600, trust_env=False) as answer:
                    record["status"], record["headers"] = answer.status_code, dict(answer.headers)
                    self.send_response(answer.status_code)
                    for key, value in answer.headers.items():
                        if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(key, value)
                    self.end_headers()
                    for chunk in answer.iter_raw():
                        record["response"] += chunk
                        self.wfile.write(chunk)
                        self.wfile.flush()

            do_GET = do_POST = do_DELETE = relay

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Relay)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def posts(self, path: str) -> list[dict]:
        """The POST exchanges to `path` (a query string such as Claude Code's ?beta=true aside)."""
        return [x for x in self.exchanges if x["method"] == "POST" and x["path"].split("?")[0] == path]

    def log(self) -> str:
        """One block per exchange: the request's gist, the status, and the answer (an OpenAI chat stream as its
        chunk count, text, finish reasons and usage; other streams as their event types)."""
        blocks = []
        for x in self.exchanges:
            try:
                body = json.loads(x["request"] or b"{}")
            except ValueError:
                body = {"unparsed": x["request"][:200].decode(errors="replace")}
            gist = {k: body[k] for k in ("model", "stream", "max_tokens", "max_output_tokens", "tool_choice")
                    if k in body}
            gist["messages"] = [m.get("role") for m in body.get("messages", [])]
            gist["input"] = [i.get("type", "message") for i in body.get("input", []) if isinstance(i, dict)]
            gist["tools"] = [t.get("name") or t.get("function", {}).get("name") for t in body.get("tools", [])]
            answer = x["response"].decode(errors="replace")
            if body.get("stream") and x["status"] == 200:
                if x["path"].startswith("/v1/chat/completions"):
                    chunks = sse_chunks(x["response"])
                    answer = json.dumps({
                        "chunks": len(chunks), "usage": chunks[-1].get("usage"),
                        "finish_reasons": [ch["finish_reason"] for c in chunks for ch in c["choices"]
                                           if ch["finish_reason"]],
                        "content": "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])})
                else:
                    events = sse_events(x["response"])
                    answer = json.dumps({"events": [data.get("type") for _, data in events],
                                         "last": events[-1][1] if events else None})
            blocks.append(f"> {x['method']} {x['path']} {json.dumps(gist)}\n< {x['status']} {answer[:2000]}")
        return "\n".join(blocks)


def sse_chunks(raw: bytes) -> list[dict]:
    """The JSON chunks of an OpenAI stream; each `data:` line must parse, and the stream must end with [DONE]."""
    data = [line[len("data: "):] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", raw[-300:]
    return [json.loads(d) for d in data[:-1]]


def sse_events(raw: bytes) -> list[tuple[str | None, dict]]:
    """The (event name, JSON data) of each server-sent event of a Responses or Messages stream."""
    events = []
    for block in raw.decode().strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        events.append((fields.get("event"), json.loads(fields["data"])))
    return events
