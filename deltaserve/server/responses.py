"""The Responses API's routes: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

The one shape every API has: parse (responses_wire.py, responses_translate.py; a previous response's items from the
store), the chat request and its SamplingParams (the shared chat step, chat.py: images, template, output settings
and grammar; generation.py `choice_params`), the engine's events (generation.py `submit`), render (items whole,
responses_translate.py, or the Responses event stream, responses_stream.py).
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request, Response

from deltaserve.server import responses_translate as translate
from deltaserve.server.chat import prepare_chat
from deltaserve.server.generation import EventStream, choice_params, collect, submit
from deltaserve.server.response_store import ResponseStore
from deltaserve.server.responses_stream import stream_events
from deltaserve.server.responses_tools import DROPPED_TOOLS_HEADER, ServedTools, served_tools
from deltaserve.server.responses_wire import ResponsesRequest
from deltaserve.server.state import ApiError, ServerState, receive
from deltaserve.text.chat_output import ChatOutputParser, parse_whole


def add_routes(app: FastAPI, state: ServerState) -> ResponseStore:
    """Register the routes on `app`; the store they share (--responses-store-bytes) is returned."""
    store = ResponseStore(state.config.responses_store_bytes)
    logged_drops: set[str] = set()  # built-in tool types already named in the log

    def name_dropped(tools: ServedTools, response: Response) -> None:
        """The built-in tools left out: in this response's header, and in the log the first time each type comes."""
        if not tools.dropped:
            return
        response.headers[DROPPED_TOOLS_HEADER] = ", ".join(tools.dropped)
        new = sorted(set(tools.dropped) - logged_drops)
        if new:
            logged_drops.update(new)
            state.log(f"responses: built-in tools this server does not run are left out of what the model sees: "
                      f"{', '.join(new)} (each response names them in its {DROPPED_TOOLS_HEADER} header)")

    def stored(response_id: str, field: str):
        entry = store.get(response_id)
        if entry is None:  # a follow-up naming a lost response is the request's fault; a lookup is not found
            raise ApiError(400 if field == "previous_response_id" else 404, store.missing(response_id, field),
                           param=field, code="response_not_found")
        return entry

    @app.post("/v1/responses", openapi_extra=_body_schema())
    async def create_response(request: Request, response: Response):
        received_s, engine, req = await receive(state, request, "responses", translate.parse, ResponsesRequest)
        earlier = stored(req.previous_response_id, "previous_response_id").conversation \
            if req.previous_response_id else []
        conversation = earlier + translate.input_items(req)
        chat = await prepare_chat(state, engine, translate.to_chat(req, conversation, engine.info.image_marker))
        params = choice_params(lambda _: translate.sampling_params(req, chat.grammar), reasoning_end=chat.reasoning_end)
        gen = await submit(state, engine, [chat.prompt_ids], params, received_s, images=chat.images,
                           boundaries=chat.boundaries, prompt_param="input")
        meta = translate.Meta(translate.new_id("resp"), int(time.time()), state.served_name(), req)
        tools = served_tools(req.tools)

        def usage_of(items: list[dict]) -> dict:
            counts = gen.counts()  # an output the parser read no thinking in (the model never opened one) has none
            thought = any(i["type"] == "reasoning" for i in items)
            return translate.usage(counts, counts.reasoning_tokens if thought else 0)

        def keep(body: dict) -> None:
            if req.store:
                store.put(body, conversation + body["output"])

        if req.stream:
            stream = EventStream(stream_events(gen.outputs(), ChatOutputParser(chat.settings), meta, tools,
                                               lambda: gen.finish_reasons[0], usage_of, keep), gen)
            name_dropped(tools, stream)
            return stream
        await collect(request, gen, state)
        reasoning, text, calls = parse_whole(chat.settings, gen.results()[0].text)
        status = translate.status_of(gen.finish_reasons[0])
        items = translate.output_items(reasoning, text, calls, status, tools)
        body = translate.response_body(meta, items, status, usage_of(items))
        keep(body)
        name_dropped(tools, response)
        return body

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        state.ready_engine()
        return stored(response_id, "response_id").body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        state.ready_engine()
        if not store.delete(response_id):
            stored(response_id, "response_id")
        return translate.deleted_body(response_id)

    return store


def _body_schema() -> dict:
    """The request body's JSON schema for /openapi.json, its few nested models written in place (the app's
    component list holds the OpenAI chat bodies only)."""
    schema = ResponsesRequest.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
