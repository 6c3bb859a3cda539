"""Anthropic's routes: /v1/messages and /v1/messages/count_tokens.

The one shape every API has: parse (anthropic_wire.py, anthropic_translate.py), the chat request and its
SamplingParams (the shared chat step, chat.py; generation.py `choice_params`), the engine's events (generation.py
`submit`), render (anthropic_translate.py the body, anthropic_stream.py the stream events).
Errors under these paths are answered in Anthropic's shape (app.py).
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import FastAPI, Request

from deltaserve.server import anthropic_translate
from deltaserve.server.anthropic_stream import stream_events
from deltaserve.server.anthropic_wire import CountTokensRequest, MessagesRequest
from deltaserve.server.chat import encode_chat, prepare_chat
from deltaserve.server.generation import EventStream, choice_params, collect, submit
from deltaserve.server.state import ANTHROPIC_PATH, ServerState, read_json, receive
from deltaserve.text.chat_output import ChatOutputParser, parse_whole


def add_routes(app: FastAPI, state: ServerState) -> None:
    """The Messages API and its token count."""

    @app.post(ANTHROPIC_PATH)
    async def messages(request: Request):
        received_s, engine, req = await receive(state, request, "messages", anthropic_translate.parse, MessagesRequest)
        chat = await prepare_chat(state, engine, anthropic_translate.to_chat(req, engine.info.image_marker))
        params = choice_params(lambda _: anthropic_translate.sampling_params(req, chat.grammar),
                               reasoning_end=chat.reasoning_end)
        gen = await submit(state, engine, [chat.prompt_ids], params, received_s, images=chat.images,
                           boundaries=chat.boundaries, prompt_param="messages")
        msg_id, model = f"msg_{uuid.uuid4().hex}", state.served_name()

        if req.stream:
            return EventStream(stream_events(gen.outputs(), ChatOutputParser(chat.settings), msg_id, model,
                                             gen.prompt_len(0)), gen)
        await collect(request, gen, state)
        reasoning, text, calls = parse_whole(chat.settings, gen.results()[0].text)
        stop, counts = anthropic_translate.stop_sequence(gen.stops[0]), gen.counts()
        reason = anthropic_translate.stop_reason(gen.finish_reasons[0], bool(calls), stop)
        return anthropic_translate.message_body(msg_id, model, reasoning, text, calls, reason, stop,
                                                counts.prompt_tokens, counts.completion_tokens, counts.cached_tokens,
                                                counts.speculative)

    @app.post(f"{ANTHROPIC_PATH}/count_tokens")
    async def count_tokens(request: Request):
        engine = state.ready_engine()
        req = anthropic_translate.parse(CountTokensRequest, await read_json(request, state.config))
        state.check_model(req.model)
        chat = anthropic_translate.to_chat(req)
        ids = await asyncio.to_thread(encode_chat, engine, chat.messages, True, chat.template_kwargs)
        return {"input_tokens": len(ids)}
