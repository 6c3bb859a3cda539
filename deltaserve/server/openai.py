"""OpenAI's routes: /v1/chat/completions, /v1/completions and /v1/models.

Each route is the one shape every API has: parse (openai_wire.py, openai_translate.py), the chat request and its
SamplingParams (the shared chat step, chat.py, or the prompts encoded; generation.py `choice_params`), the engine's
events (generation.py `submit`), render (openai_stream.py streamed, openai_translate.py whole).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request

from deltaserve.engine.engine import Engine
from deltaserve.server import openai_translate
from deltaserve.server.chat import prepare_chat
from deltaserve.server.generation import EventStream, choice_params, collect, submit
from deltaserve.server.openai_stream import chat_events, completion_events
from deltaserve.server.openai_wire import ChatCompletionRequest, CompletionRequest, body_schema
from deltaserve.server.state import ApiError, ServerState, receive
from deltaserve.text.chat_output import ChatOutputParser, parse_whole


def add_routes(app: FastAPI, state: ServerState) -> None:
    """OpenAI's generation routes and its model list."""

    @app.get("/v1/models")
    async def models():
        engine = state.ready_engine()
        return openai_translate.model_list([state.served_name()], state.started_s, engine.info.context_length)

    @app.post("/v1/chat/completions", openapi_extra=body_schema("ChatCompletionRequest"))
    async def chat_completions(request: Request):
        received_s, engine, req = await receive(state, request, "chat", openai_translate.parse_request, ChatCompletionRequest)
        chat = await prepare_chat(state, engine, openai_translate.to_chat(req, engine.info.image_marker))
        params = choice_params(lambda j: openai_translate.sampling_params(req, j, chat.grammar), req.n,
                               chat.reasoning_end)
        gen = await submit(state, engine, [chat.prompt_ids], params, received_s, images=chat.images,
                           boundaries=chat.boundaries, prompt_param="messages")
        meta = openai_translate.ResponseMeta(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.served_name())
        token_bytes = engine.tokenizer.token_bytes
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            parsers = [ChatOutputParser(chat.settings) for _ in gen.streams]
            return EventStream(chat_events(gen, meta, include_usage, token_bytes, parsers), gen)
        await collect(request, gen, state)
        results = gen.results()
        for result in results:
            result.reasoning, result.text, result.tool_calls = parse_whole(chat.settings, result.text)
        return openai_translate.chat_completion(meta, results, openai_translate.usage(gen.counts()), token_bytes)

    @app.post("/v1/completions", openapi_extra=body_schema("CompletionRequest"))
    async def completions(request: Request):
        received_s, engine, req = await receive(state, request, "completions", openai_translate.parse_request, CompletionRequest)
        prompts = await asyncio.to_thread(_completion_prompts, engine, req.prompt)
        params = choice_params(lambda j: openai_translate.sampling_params(req, j), req.n)
        gen = await submit(state, engine, prompts, params, received_s)
        meta = openai_translate.ResponseMeta(f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.served_name())
        echoes = [_echo_text(engine, req.prompt, prompts, p) if req.echo else "" for p in gen.choice_prompt]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(completion_events(gen, meta, include_usage, echoes), gen)
        await collect(request, gen, state)
        return openai_translate.completion(meta, gen.results(), openai_translate.usage(gen.counts()), echoes)


def _prompt_texts(prompt) -> list[str]:
    return [prompt] if isinstance(prompt, str) else list(prompt)


def _echo_text(engine: Engine, prompt, prompts: list[list[int]], p: int) -> str:
    """The text of prompt p, as the client sent it (or decoded, when it sent token ids)."""
    return _prompt_texts(prompt)[p] if _is_text(prompt) else engine.tokenizer.decode(prompts[p])


def _is_text(prompt) -> bool:
    return isinstance(prompt, str) or isinstance(prompt[0], str)


def _completion_prompts(engine: Engine, prompt) -> list[list[int]]:
    """Token ids of each prompt (a string, strings, token ids, or lists of token ids)."""
    tok = engine.tokenizer
    if _is_text(prompt):
        prompts = [tok.encode(text) for text in _prompt_texts(prompt)]
    else:
        prompts = [prompt] if isinstance(prompt[0], int) else prompt
        for p, ids in enumerate(prompts):
            bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"prompt[{p}]: token id {bad} is outside the vocabulary (0..{tok.vocab_size - 1})",
                               param="prompt")
    for p, ids in enumerate(prompts):
        if not ids:
            raise ApiError(400, f"prompt[{p}] is empty (0 tokens): send at least one token", param="prompt")
    return prompts
