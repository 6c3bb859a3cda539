"""The deployment's front door: a pass-through on the router's public port that rewrites one answer, GET /v1/models.

vllm-router 0.1.17 (the newest on PyPI) answers /v1/models in its multi-model mode with `{"models": ["chat",
"agents"]}`, not OpenAI's list, so `openai.OpenAI(base_url=router).models.list()` (and every client that discovers
models that way) breaks; its upstream source has since changed that answer to OpenAI's shape. Until a release
carries it, `up` starts the router on an internal port and this layer on the public one: every request and answer
passes through unchanged, streams chunk by chunk, except that a router's `{"models": [...]}` becomes
`{"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}]}`. It routes nothing itself.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


def openai_model_list(body, created: int) -> dict | None:
    """A router's `{"models": [names]}` as OpenAI's model list; None when the body is some other shape (already
    OpenAI's, or an error), which then passes unchanged."""
    if not isinstance(body, dict) or set(body) != {"models"} or not isinstance(body["models"], list) \
            or not all(isinstance(name, str) for name in body["models"]):
        return None
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "deltaserve"}
                                       for name in body["models"]]}


def create_app(upstream: str) -> Starlette:
    """The pass-through to the router at `upstream`."""
    client = httpx.AsyncClient(base_url=upstream, timeout=None, trust_env=False)  # the router is local
    started_s = int(time.time())

    async def relay(request: Request) -> Response:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]
        outgoing = client.build_request(request.method, request.url.path, params=request.query_params,
                                        headers=headers, content=await request.body())
        answer = await client.send(outgoing, stream=True)
        passed = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS}
        if request.method == "GET" and request.url.path == "/v1/models" and answer.status_code == 200:
            raw = await answer.aread()
            await answer.aclose()
            try:
                listed = openai_model_list(json.loads(raw), started_s)
            except ValueError:
                listed = None
            if listed is not None:
                return JSONResponse(listed)
            return Response(raw, status_code=answer.status_code, headers=passed)
        # a client that leaves mid-stream ends the iteration; closing the upstream answer tells the router
        return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code, headers=passed,
                                 background=BackgroundTask(answer.aclose))

    @asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    return Starlette(routes=[Route("/{path:path}", relay, methods=METHODS)], lifespan=lifespan)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="the deployment's front door in front of vllm-router")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the router's internal URL")
    args = parser.parse_args(argv)
    uvicorn.run(create_app(args.upstream), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
