"""The admin routes: /health, /metrics, /v1/budget, /flush_cache, vLLM's /tokenize and /detokenize, and what a
router asks a worker (/server_info, /model_info, /get_load: router_info.py)."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from deltaserve.server import openai_translate, protocol, router_info
from deltaserve.server.chat import encode_chat
from deltaserve.server.openai_wire import DetokenizeRequest, TokenizeRequest, body_schema
from deltaserve.server.state import ApiError, ServerState, read_json


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Health, metrics, the ledger, the prefix cache's flush, tokenizing, and the router's questions."""

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
        body, content_type = await asyncio.to_thread(state.metrics.render)  # stats: the engine's answer
        return Response(body, media_type=content_type)

    @app.get("/v1/budget")
    async def budget():
        engine = state.ready_engine()
        budget_json = engine.info.budget.to_json()
        body = json.loads(budget_json) if isinstance(budget_json, str) else budget_json
        s = await asyncio.to_thread(engine.stats)  # answered by the engine's thread between steps
        body["prefix_cache"] = {"enabled": engine.info.prefix_cache, "pages": s.prefix_cache_pages,
                                "hit_tokens_total": s.prefix_cache_hit_tokens_total,
                                "checkpoints_used": s.checkpoints_used, "checkpoints_total": s.checkpoints_total}
        return body

    @app.post("/flush_cache")
    async def flush_cache():
        """Drop every cached page and checkpoint that no running request uses."""
        return {"freed_pages": await asyncio.to_thread(state.ready_engine().flush_cache)}

    # What a router (sglang-router) asks of a worker: its served model name, its model, its load.
    @app.get("/server_info")
    @app.get("/get_server_info", include_in_schema=False)
    async def server_info():
        return router_info.server_info(state.ready_engine().info, state.served_name())

    @app.get("/model_info")
    @app.get("/get_model_info", include_in_schema=False)
    async def model_info():
        return router_info.model_info(state.ready_engine().info)

    @app.get("/get_load")
    async def get_load():
        engine = state.ready_engine()
        return [router_info.load(await asyncio.to_thread(engine.stats), engine.info)]

    @app.post("/tokenize", openapi_extra=body_schema("TokenizeRequest"))
    async def tokenize(request: Request):
        engine = state.ready_engine()
        req = openai_translate.parse_request(TokenizeRequest, await read_json(request, state.config))
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
        if req.prompt is not None:
            ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt, req.add_special_tokens)
        else:
            ids = await asyncio.to_thread(encode_chat, engine, openai_translate.chat_messages(req),
                                          req.add_generation_prompt, openai_translate.chat_template_kwargs(req))
        return {"count": len(ids), "max_model_len": engine.info.context_length, "tokens": ids}

    @app.post("/detokenize", openapi_extra=body_schema("DetokenizeRequest"))
    async def detokenize(request: Request):
        engine = state.ready_engine()
        req = openai_translate.parse_request(DetokenizeRequest, await read_json(request, state.config))
        state.check_model(req.model)
        vocab_size = engine.tokenizer.vocab_size
        bad = next((t for t in req.tokens if t >= vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"tokens: token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                           param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}
