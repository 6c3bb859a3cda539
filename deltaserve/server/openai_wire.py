"""OpenAI's wire types: the bodies of /v1/chat/completions, /v1/completions and /v1/models, and of vLLM's /tokenize
and /detokenize, as pydantic models: what a request may hold, what a response holds, and the JSON schemas the OpenAPI
document shows. Reading a request into engine terms and filling the responses is openai_translate.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_serializer

from deltaserve.engine.door import MAX_CHOICES
from deltaserve.server.protocol import INT64_MAX, INT64_MIN, MAX_COUNT, MAX_STOPS

MAX_TOP_LOGPROBS = 20

FinishReason = Literal["stop", "length", "tool_calls"]
TokenId = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Text = Annotated[str, Field(min_length=1)]
# Checked in openai_translate with a clearer message than pydantic's; the schema still states the rule.
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
    max_tokens: int | None = Field(None, ge=0, le=MAX_COUNT)  # 0: only with echo and logprobs (score the prompt)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: Annotated[str | None, WithJsonSchema({"type": "null"})] = None  # refused with a message when set
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied instead of computing them


class SpeculativeUsage(BaseModel):
    drafted: int = 0  # draft tokens verified for the response's choices (--speculative)
    accepted: int = 0  # of them, those the model agreed with (each saved a step)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    speculative: SpeculativeUsage | None = None  # only from a server that speculates

    @model_serializer(mode="wrap")
    def _speculative_when_on(self, handler) -> dict[str, Any]:
        data = handler(self)
        if data.get("speculative") is None:
            data.pop("speculative", None)
        return data


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
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
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


REQUEST_MODELS = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)


def request_body_schemas() -> dict[str, dict]:
    """JSON schemas of the request bodies, for the OpenAPI document (refs under #/components/schemas)."""
    from pydantic.json_schema import models_json_schema

    _, top = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                ref_template="#/components/schemas/{model}")
    return top.get("$defs", {})


def body_schema(name: str) -> dict:
    """A route's `openapi_extra` naming its request body (the routes read bodies themselves, with a size limit)."""
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}
