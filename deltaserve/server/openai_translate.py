"""OpenAI's requests in engine terms, and engine outputs as OpenAI's bodies: the checks beyond the schema, chat
messages for the template (an image part becomes the model's image placeholder), tool_choice and response_format
(read into output_request.py's shared checks), SamplingParams per choice; the completion bodies, streamed chunks
(which openai_stream.py sends), logprobs and usage.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from deltaserve.engine.request import SamplingParams, TokenLogprob
from deltaserve.images import ImageSource
from deltaserve.server import output_request
from deltaserve.server.chat import ChatRequest
from deltaserve.server.generation import ChoiceResult, TokenCounts
from deltaserve.server.openai_wire import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                           ChatCompletionChunk, ChatCompletionRequest, ChatDelta, ChatLogprobs,
                                           ChatTokenLogprob, Completion, CompletionChoice, CompletionLogprobs,
                                           CompletionRequest, FinishReason, FunctionCall, ModelCard, ModelList,
                                           PromptTokensDetails, SpeculativeUsage, ToolCallOut, TopLogprob, Usage,
                                           _Body, _SamplingFields)
from deltaserve.server.output_request import ANY_OBJECT, format_schema
from deltaserve.server.protocol import MAX_COUNT, MAX_STOPS, ProtocolError, sse_event, validation_message

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI reports impossible tokens this way


def parse_request(model: type[_Body], body: Any) -> _Body:
    """Validate a decoded JSON body; every problem becomes one ProtocolError naming the field."""
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        raise ProtocolError(*validation_message(e)) from None
    if isinstance(request, _SamplingFields):
        _check_common(request)
    return request


def _check_common(req: _SamplingFields) -> None:
    stops = stop_strings(req)
    if len(stops) > MAX_STOPS:
        raise ProtocolError(f"stop: at most {MAX_STOPS} stop strings are supported, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise ProtocolError("stop: a stop string must not be empty", "stop")
    if req.stop_token_ids and any(t < 0 or t > MAX_COUNT for t in req.stop_token_ids):
        raise ProtocolError("stop_token_ids: token ids must be non-negative", "stop_token_ids")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise ProtocolError("top_logprobs: requires logprobs to be true", "top_logprobs")
        response_format_schema(req)
        forced_tool(req)
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise ProtocolError("suffix: insertion (a suffix after the completion) is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ProtocolError(f"best_of: only best_of == n is supported (got best_of={req.best_of}, n={req.n})",
                                "best_of")
        scored = req.echo and req.logprobs is not None
        if req.max_tokens == 0 and not scored:
            raise ProtocolError("max_tokens: 0 only scores the prompt: it needs echo true and logprobs set",
                                "max_tokens")
        if scored and req.n != 1:
            raise ProtocolError(f"n: echo with logprobs scores the prompt once: n must be 1, got {req.n}", "n")
        if scored and req.stream:
            raise ProtocolError("stream: echo with logprobs (prompt log-probabilities) is not streamed; "
                                "send stream false", "stream")


def stop_strings(req: _SamplingFields) -> tuple[str, ...]:
    """`stop` as a tuple of strings (the API takes one string or a list)."""
    if req.stop is None:
        return ()
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)


def chat_messages(req: ChatCompletionRequest, images: list[ImageSource] | None = None,
                  image_marker: str = "") -> list[dict]:
    """The messages as plain dicts for the chat template; text parts joined, other parts refused.

    With `images` (a list to fill), each image_url part becomes `image_marker` in the text (the model's image
    placeholder) and its source is appended to `images`; without, image parts are refused."""
    out = []
    for i, message in enumerate(req.messages):
        item = message.model_dump(exclude_none=True)
        item.setdefault("content", "")  # templates read message.content even where the API allows null
        if message.tool_calls:
            item["tool_calls"] = [_template_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                                  for j, call in enumerate(message.tool_calls)]
        if isinstance(message.content, list):
            texts = []
            for j, part in enumerate(message.content):
                if part.type == "image_url" and images is not None and part.image_url is not None:
                    images.append(ImageSource(f"messages[{i}].content[{j}].image_url", part.image_url.url))
                    texts.append(image_marker)
                    continue
                if part.type != "text" or part.text is None:
                    what = "a text part without 'text'" if part.type == "text" else f"{part.type!r} parts"
                    raise ProtocolError(f"messages[{i}].content[{j}]: only text is supported, not {what}",
                                        f"messages[{i}].content[{j}]")
                texts.append(part.text)
            item["content"] = "".join(texts)
        out.append(item)
    return out


def _template_tool_call(call: dict, where: str) -> dict:
    """A prior call as templates read it: arguments as an object (the API sends them as a JSON string)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ProtocolError(f"{where}: a tool call needs function.name", where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError as e:
            raise ProtocolError(f"{where}.function.arguments: not valid JSON: {e}", where) from None
    return {**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments}}


def response_format_schema(req: ChatCompletionRequest) -> dict | None:
    """The JSON schema `response_format` asks for (json_object: any object), None for text; a json_schema without a
    schema is any object too."""
    fmt = req.response_format
    if not fmt:
        return None
    spec = fmt.get("json_schema")
    schema = spec.get("schema", {}) if isinstance(spec, dict) else None
    if schema == {}:  # a json_schema format without a schema: any object
        schema = dict(ANY_OBJECT)
    return format_schema(fmt.get("type", "text"), schema, "response_format",
                         schema_field="response_format.json_schema.schema")


def tool_names(req: ChatCompletionRequest) -> list[str]:
    return [t.get("function", {}).get("name") for t in req.tools or [] if isinstance(t, dict)]


def forced_tool(req: ChatCompletionRequest) -> tuple[str, str | None] | None:
    """("required", None) or ("named", name) when tool_choice forces a call; None for auto / none."""
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if choice != "required" and not isinstance(name, str) and req.tools:
        raise ProtocolError("tool_choice: must be 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    return output_request.forced_tool("required" if choice == "required" else "named", name, tool_names(req),
                                      json.dumps(choice), name_param="tool_choice")


def to_chat(req: ChatCompletionRequest, image_marker: str) -> ChatRequest:
    """The request in the shared chat step's terms (server/chat.py): image parts become `image_marker` (the model's;
    "" where it takes no images, which the door then refuses) and their sources the chat's `images`."""
    images: list[ImageSource] = []
    messages = chat_messages(req, images, image_marker)
    forced = forced_tool(req)
    return ChatRequest(messages, tools=req.tools, template_kwargs=chat_template_kwargs(req),
                       tool_choice=forced[0] if forced else (req.tool_choice or "auto"),
                       forced_name=forced[1] if forced else None, parallel=req.parallel_tool_calls is not False,
                       response_schema=response_format_schema(req), images=images,
                       add_generation_prompt=req.add_generation_prompt)


def chat_template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """Extra variables for the chat template: `tools`, and whatever `chat_template_kwargs` carries."""
    kwargs = dict(req.chat_template_kwargs or {})
    for reserved in ("messages", "add_generation_prompt"):
        kwargs.pop(reserved, None)
    if req.tools:
        kwargs["tools"] = req.tools
    return kwargs


def max_new_tokens(req: _SamplingFields) -> int | None:
    """The client's completion limit (`max_completion_tokens` wins over the older `max_tokens`)."""
    return getattr(req, "max_completion_tokens", None) or req.max_tokens


def logprobs_count(req: _SamplingFields) -> int | None:
    """How many top alternatives to report per token; None when logprobs are off."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def sampling_params(req: _SamplingFields, choice: int, grammar: str | None = None) -> SamplingParams:
    """SamplingParams for one choice; choices of one request differ by seed (seed + choice)."""
    options: dict[str, Any] = {
        "max_tokens": max_new_tokens(req), "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "seed": None if req.seed is None else (req.seed + choice) % 2**63,
        "stop": stop_strings(req), "stop_token_ids": tuple(req.stop_token_ids or ()),
        "ignore_eos": req.ignore_eos, "logprobs": logprobs_count(req),
        "skip_special_tokens": req.skip_special_tokens, "grammar": grammar, "logit_bias": logit_bias(req),
        "prompt_logprobs": req.logprobs if isinstance(req, CompletionRequest) and req.echo else None,
    }
    if req.top_k is not None and req.top_k <= 0:
        options["top_k"] = None  # -1 / 0 mean "no top-k" in the OpenAI-compatible dialects
    return SamplingParams(**{k: v for k, v in options.items() if v is not None})


def logit_bias(req: _SamplingFields) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's {"token id": bias} as (id, bias) pairs; a key that is not a token id is a 400 naming it."""
    if not req.logit_bias:
        return None
    pairs = []
    for key, bias in req.logit_bias.items():
        if not (key.isascii() and key.isdigit()):
            raise ProtocolError(f"logit_bias: key {key!r} is not a token id (a non-negative integer in a string)",
                                "logit_bias")
        pairs.append((int(key), bias))
    return tuple(pairs)


def usage(counts: TokenCounts) -> Usage:
    """OpenAI's usage object; `cached_tokens` (of the prompt's) came from the prefix cache; `speculative`
    ({"drafted", "accepted"} draft tokens) only where the server speculates."""
    speculative = counts.speculative
    return Usage(prompt_tokens=counts.prompt_tokens, completion_tokens=counts.completion_tokens,
                 total_tokens=counts.prompt_tokens + counts.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=counts.cached_tokens),
                 speculative=SpeculativeUsage(**speculative) if speculative is not None else None)


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def chat_logprobs(entries: list[TokenLogprob], token_bytes) -> ChatLogprobs:
    """Chat-style logprobs: per token its text, logprob, UTF-8 bytes and the top alternatives."""
    content = [ChatTokenLogprob(
        token=e.token, logprob=_logprob(e.logprob), bytes=list(token_bytes(e.token_id)),
        top_logprobs=[TopLogprob(token=text, logprob=_logprob(lp), bytes=list(token_bytes(tid)))
                      for tid, text, lp in e.top]) for e in entries]
    return ChatLogprobs(content=content)


def completion_logprobs(entries: list[TokenLogprob], text_start: int,
                        prompt: list[TokenLogprob] | None = None) -> CompletionLogprobs:
    """Completions-style logprobs; `text_start` is the offset of the first token in the choice's text; `prompt`:
    an echoed prompt's tokens before them, from offset 0 (the first one's log-prob and top None)."""
    offsets = []
    for start, part in ((0, prompt or []), (text_start, entries)):
        for e in part:
            offsets.append(start)
            start += len(e.token)
    both = (prompt or []) + entries
    return CompletionLogprobs(
        tokens=[e.token for e in both],
        token_logprobs=[None if e.logprob is None else _logprob(e.logprob) for e in both],
        top_logprobs=[None if e.top is None else {text: _logprob(lp) for _, text, lp in e.top} for e in both],
        text_offset=offsets)


def finish_reason(engine_reason: str | None, called: bool = False) -> FinishReason | None:
    """The engine's "stop"/"length" pass through ("tool_calls" when the turn ended in calls)."""
    if engine_reason == "stop" and called:
        return "tool_calls"
    return engine_reason if engine_reason in ("stop", "length") else None


@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str


def chat_completion(meta: ResponseMeta, choices: list[ChoiceResult], totals: Usage,
                    token_bytes: Callable[[int], bytes]) -> dict:
    """The non-streamed chat body."""
    return ChatCompletion(id=meta.id, created=meta.created, model=meta.model, usage=totals, choices=[
        ChatChoice(index=c.index, message=AssistantMessage(
            content=c.text if c.text or not c.tool_calls else None, reasoning_content=c.reasoning or None,
            tool_calls=_tool_calls_out(c.tool_calls)),
                   finish_reason=finish_reason(c.finish_reason, bool(c.tool_calls)),
                   logprobs=None if c.logprobs is None else chat_logprobs(c.logprobs, token_bytes))
        for c in choices]).model_dump()


def _tool_calls_out(calls: list | None) -> list[ToolCallOut] | None:
    """Parsed calls (text.tool_parsers.ToolCall) as the message's tool_calls; None when there are none."""
    if not calls:
        return None
    return [ToolCallOut(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments)) for t in calls]


def chat_chunk(meta: ResponseMeta, index: int, *, role: bool = False, text: str | None = None,
               logprobs: list[TokenLogprob] | None = None, finish: str | None = None,
               token_bytes: Callable[[int], bytes] | None = None, reasoning: str | None = None,
               calls: list | None = None, called: bool = False) -> bytes:
    """One streamed chat event for one choice: the role, a delta (text, reasoning, tool-call pieces with OpenAI's
    index / id / name first, then argument fragments), or the finish."""
    delta = ChatDelta(role="assistant", content="") if role else ChatDelta(
        content=text, reasoning_content=reasoning or None, tool_calls=[_call_delta(d) for d in calls] if calls else None)
    choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason(finish, called),
                             logprobs=None if logprobs is None else chat_logprobs(logprobs, token_bytes))
    return sse_event(ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[choice]))


def _call_delta(d) -> dict:
    """A text.tool_parsers.ToolDelta as OpenAI's streamed tool_calls item."""
    if d.name is not None:
        return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
    return {"index": d.index, "function": {"arguments": d.arguments}}


def chat_usage_chunk(meta: ResponseMeta, totals: Usage) -> bytes:
    """The last streamed chat event when `stream_options.include_usage`: no choices, the usage."""
    return sse_event(ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[],
                                         usage=totals))


def completion(meta: ResponseMeta, choices: list[ChoiceResult], totals: Usage, echoes: list[str]) -> dict:
    """The non-streamed completions body; `echoes[i]` is the prompt text echoed before choice i."""
    return Completion(id=meta.id, created=meta.created, model=meta.model, usage=totals, choices=[
        CompletionChoice(index=c.index, text=echoes[c.index] + c.text, finish_reason=finish_reason(c.finish_reason),
                         logprobs=None if c.logprobs is None and c.prompt_logprobs is None
                         else completion_logprobs(c.logprobs or [], len(echoes[c.index]), c.prompt_logprobs))
        for c in choices]).model_dump()


def completion_chunk(meta: ResponseMeta, index: int, text: str, *, logprobs: list[TokenLogprob] | None = None,
                     text_start: int = 0, finish: str | None = None) -> bytes:
    """One streamed completions event for one choice; `text_start` is where `text` begins in the choice."""
    choice = CompletionChoice(index=index, text=text, finish_reason=finish_reason(finish),
                              logprobs=None if logprobs is None else completion_logprobs(logprobs, text_start))
    return sse_event(Completion(id=meta.id, created=meta.created, model=meta.model, choices=[choice]))


def completion_usage_chunk(meta: ResponseMeta, totals: Usage) -> bytes:
    return sse_event(Completion(id=meta.id, created=meta.created, model=meta.model, choices=[], usage=totals))


def model_list(names: list[str], created: int, context_length: int) -> dict:
    return ModelList(data=[ModelCard(id=name, created=created, max_model_len=context_length)
                           for name in names]).model_dump()
