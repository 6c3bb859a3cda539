"""OpenAI's Responses API request body (`POST /v1/responses`), as pydantic models; responses_translate.py reads it.

Input items stay dicts here: responses_translate.input_messages reads them, with errors that name the item.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deltaserve.server.protocol import MAX_COUNT


class _Body(BaseModel):
    """Unknown fields ignored (Codex sends `include`, `prompt_cache_key`, ...), strict types, no NaN."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class TextConfig(_Body):
    format: dict[str, Any] | None = None
    verbosity: str | None = None  # a hint to OpenAI's own models; nothing here reads it


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension, as on chat completions

