"""Anthropic's Messages API wire types: the request bodies of /v1/messages and /v1/messages/count_tokens as pydantic
models, and Anthropic's error shape. Turning a request into a chat for the template, and engine outputs into
Anthropic's bodies, is anthropic_translate.py; its stream events are anthropic_stream.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deltaserve.server.protocol import MAX_COUNT, MAX_STOPS

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ImageBlockSource(_Body):
    type: str  # base64 (served) or url (refused: the server fetches nothing)
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class Block(_Body):
    """A content block: text, image (where the model has a vision tower), tool_use, tool_result or thinking."""

    type: str
    source: ImageBlockSource | None = None
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None


class Message(_Body):
    role: Literal["user", "assistant", "system"]  # Claude Code sends system messages after the first turn too
    content: str | list[Block]


class Tool(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # read, not enforced: max_tokens bounds the thinking and the answer together


class OutputConfig(_Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # low turns adaptive thinking off
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": ...}: the grammar holds the answer to it


class MessagesRequest(_Body):
    model: str | None = None
    max_tokens: int = Field(ge=1, le=MAX_COUNT)
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOPS)
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_COUNT)
    stream: bool = False
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # Read and not acted on: no context edit is applied (the prompt is served whole, and one that does not fit is
    # refused), and metadata (user_id) is no one's business here.
    context_management: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: int | None = None


def error_body(status: int, message: str) -> dict:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
