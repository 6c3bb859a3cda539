"""The OpenAI wire format: request and response bodies as pydantic models, and the builders that fill them.

Only this module knows field names of the OpenAI API; app.py speaks in engine terms (prompt ids,
SamplingParams, RequestOutput) and asks this module for bodies.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, model_serializer

from deltaserve.engine.request import SamplingParams, TokenLogprob
from deltaserve.images import ImageSource

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_COUNT = 2**31 - 1  # token counts beyond int32 are a client mistake, not a request
MAX_CHOICES = 16  # n × prompts per request; each is one engine request
MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI reports impossible tokens this way

FinishReason = Literal["stop", "length", "tool_calls"]
TokenId = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Text = Annotated[str, Field(min_length=1)]
# Checked in _check_common with a clearer message than pydantic's; the schema still states the rule.
StopString = Annotated[str, WithJsonSchema({"type": "string", "minLength": 1})]


class _Body(BaseModel):
    """Unknown fields are ignored (clients send many we do not use); NaN and Infinity are refused; types are strict
    ("5" is not a number, "yes" not a boolean, true not a token id), as OpenAI and vLLM answer; a float field still
    takes an integer (temperature 1)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class ImageURL(_Body):
    url: str
    detail: str | None = None


class ContentPart(_Body):
    """Text and image_url parts are served (images where the model has a vision tower); other types get a 400
    naming the part (checked in chat_messages)."""

    model_config = ConfigDict(json_schema_extra={"required": ["type"]})
    type: Annotated[str, WithJsonSchema({"type": "string", "enum": ["text", "image_url"]})]
    text: Annotated[str | None, WithJsonSchema({"type": "string"})] = None
    image_url: ImageURL | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class _SamplingFields(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_COUNT)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOPS)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # token id (a string) -> bias
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_SamplingFields):
    prompt: (Text | Annotated[list[Text], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: Annotated[str | None, WithJsonSchema({"type": "null"})] = None  # refused with a message when set
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied instead of computing them


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer
    def _present_only(self) -> dict:
        # OpenAI sends `{}` as the delta of a finish chunk, not nulls.
        fields = (("role", self.role), ("content", self.content), ("reasoning_content", self.reasoning_content),
                  ("tool_calls", self.tool_calls))
        return {k: v for k, v in fields if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "deltaserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ProtocolError(ValueError):
    """A request body that is well-formed JSON but not a request we can serve: a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


REQUEST_MODELS = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)
SSE_DONE = b"data: [DONE]\n\n"


def parse_request(model: type[_Body], body: Any) -> _Body:
    """Validate a decoded JSON body; every problem becomes one ProtocolError naming the field."""
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        raise ProtocolError(*validation_message(e)) from None
    if isinstance(request, _SamplingFields):
        _check_common(request)
    return request


def validation_message(error: ValidationError) -> tuple[str, str | None]:
    """'messages[0].role: Input should be ... (got 'robot')' for the first problem, and its field path."""
    problems = error.errors(include_url=False)
    first = problems[0]
    union = _union_prefix(first["loc"])
    if union is not None:
        # A union field fails once per alternative: name the accepted forms instead of each failure.
        alternatives = [p for p in problems if _union_prefix(p["loc"]) == union]
        outer = min(alternatives, key=lambda p: len(p["loc"]))
        expected = UNION_FORMS.get(re.sub(r"\[\d+\]", "[]", union), "a value of one of the accepted forms")
        others = len(problems) - len(alternatives)
        more = f"; and {others} more problem(s)" if others else ""
        return f"{union}: must be {expected} (got {_short_repr(outer.get('input'))}){more}", union
    param = _field_path(first["loc"])
    got = "" if first["type"] == "missing" else f" (got {_short_repr(first.get('input'))})"
    more = f"; and {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
    where = f"{param}: " if param else "request body: "
    return f"{where}{first['msg']}{got}{more}", param


UNION_FORMS = {
    "prompt": "a non-empty string, a list of non-empty strings, a list of token ids, or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "messages[].content": "a string, a list of content parts, or null",
}
_UNION_TAG = re.compile(r"^(str|int|float|bool|list|dict|none)$|^(constrained-|function-|json-or-python)|\[")


def _union_prefix(loc: tuple) -> str | None:
    """The path of the union field a loc runs through ('prompt' for ('prompt', 'list[int]', 0)), else None."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and _UNION_TAG.search(part):
            return _field_path(loc[:i])
    return None


def _field_path(loc: tuple) -> str | None:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _UNION_TAG.search(part):
            continue
        else:
            path += f".{part}" if path else part
    return path or None


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
        if req.echo and req.logprobs is not None:
            raise ProtocolError("echo: echo with logprobs (prompt log-probabilities) is not supported", "echo")


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
    """The JSON schema `response_format` asks for (json_object: any object), None for text."""
    fmt = req.response_format
    if not fmt or fmt.get("type", "text") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "object"}
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ProtocolError("response_format.json_schema: must be an object with a 'schema' object",
                                "response_format")
        return spec.get("schema") or {"type": "object"}
    raise ProtocolError(f"response_format.type: {fmt.get('type')!r} is not supported: choose text, json_object "
                        f"or json_schema", "response_format")


def tool_names(req: ChatCompletionRequest) -> list[str]:
    return [t.get("function", {}).get("name") for t in req.tools or [] if isinstance(t, dict)]


def forced_tool(req: ChatCompletionRequest) -> tuple[str, str | None] | None:
    """("required", None) or ("named", name) when tool_choice forces a call; None for auto / none."""
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    if not req.tools:
        raise ProtocolError(f"tool_choice: {json.dumps(choice)} needs a non-empty 'tools' list", "tool_choice")
    if choice == "required":
        return "required", None
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ProtocolError("tool_choice: must be 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if name not in tool_names(req):
        raise ProtocolError(f"tool_choice: function {name!r} is not among the tools "
                            f"({', '.join(map(str, tool_names(req)))})", "tool_choice")
    return "named", name


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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    """OpenAI's usage object; `cached_tokens` (of `prompt_tokens`) came from the prefix cache."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def chat_logprobs(entries: list[TokenLogprob], token_bytes) -> ChatLogprobs:
    """Chat-style logprobs: per token its text, logprob, UTF-8 bytes and the top alternatives."""
    content = [ChatTokenLogprob(
        token=e.token, logprob=_logprob(e.logprob), bytes=list(token_bytes(e.token_id)),
        top_logprobs=[TopLogprob(token=text, logprob=_logprob(lp), bytes=list(token_bytes(tid)))
                      for tid, text, lp in e.top]) for e in entries]
    return ChatLogprobs(content=content)


def completion_logprobs(entries: list[TokenLogprob], text_start: int) -> CompletionLogprobs:
    """Completions-style logprobs; `text_start` is the offset of the first token in the choice's text."""
    offsets, offset = [], text_start
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return CompletionLogprobs(
        tokens=[e.token for e in entries], token_logprobs=[_logprob(e.logprob) for e in entries],
        top_logprobs=[{text: _logprob(lp) for _, text, lp in e.top} for e in entries], text_offset=offsets)


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


@dataclass
class ChoiceResult:
    """One finished choice, in engine terms."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    reasoning: str | None = None
    tool_calls: list | None = None  # text.tool_parsers.ToolCall


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
                         logprobs=None if c.logprobs is None else completion_logprobs(c.logprobs, len(echoes[c.index])))
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


ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable"}


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`, as the OpenAI API answers errors."""
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()


def sse_event(body: BaseModel | dict) -> bytes:
    """One server-sent event carrying a JSON body."""
    data = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
    return b"data: " + data.encode() + b"\n\n"


def request_body_schemas() -> dict[str, dict]:
    """JSON schemas of the request bodies, for the OpenAPI document (refs under #/components/schemas)."""
    from pydantic.json_schema import models_json_schema

    _, top = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                ref_template="#/components/schemas/{model}")
    return top.get("$defs", {})
