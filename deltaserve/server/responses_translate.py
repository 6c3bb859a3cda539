"""OpenAI's Responses API (`POST /v1/responses`, what Codex CLI and `client.responses` speak) in engine terms: a
request as the shared chat step's ChatRequest (server/chat.py) and its SamplingParams, and the response body, its
output items and usage.

Only this module, responses_wire.py and responses_stream.py know the Responses field names; the routes in
responses.py hand it engine outputs. The input items map onto chat messages as the chat templates read
them: message items by role, function_call items as the assistant's tool_calls, function_call_output items as
tool messages, reasoning items as the next assistant turn's reasoning_content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from deltaserve.engine.request import SamplingParams
from deltaserve.images import ImageSource
from deltaserve.server.chat import ChatRequest
from deltaserve.server.generation import TokenCounts
from deltaserve.server.output_request import format_schema
from deltaserve.server.protocol import ProtocolError, validation_message
from deltaserve.server.responses_tools import (CUSTOM_INPUT, ServedTools, flat_name, forced_tool,
                                               served_tools)
from deltaserve.server.responses_wire import ResponsesRequest
from deltaserve.text.tool_parsers import ToolCall

# Effort levels that ask for no thinking: the template's enable_thinking switch is turned off for them.
NO_THINKING_EFFORTS = ("none", "minimal")
MESSAGE_ROLES = ("user", "assistant", "system", "developer")


def parse(model: type[ResponsesRequest], body: Any) -> ResponsesRequest:
    """Validate a decoded body; a problem becomes a ProtocolError naming the field."""
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise ProtocolError(*validation_message(e)) from None
    forced_tool(req.tool_choice, served_tools(req.tools))
    response_schema(req)
    return req


def input_items(req: ResponsesRequest) -> list[dict]:
    """`input` as a list of items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return req.input


def to_chat(req: ResponsesRequest, items: list[dict], image_marker: str = "") -> ChatRequest:
    """The conversation (`items`: a stored conversation's items, then this request's input) as a chat, with
    `instructions` as the system message first (instructions never carry over from a previous response)."""
    images: list[ImageSource] = []
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += input_messages(items, images, image_marker)
    served = served_tools(req.tools)
    tools = served.chat or None
    forced = forced_tool(req.tool_choice, served)
    choice = forced[0] if forced else (req.tool_choice if isinstance(req.tool_choice, str) else "auto")
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in ("messages",
                                                                                    "add_generation_prompt")}
    if tools:
        kwargs["tools"] = tools
    effort = req.reasoning.effort if req.reasoning else None
    if effort is not None:
        kwargs["enable_thinking"] = effort not in NO_THINKING_EFFORTS
    return ChatRequest(messages, tools, kwargs, choice, forced[1] if forced else None,
                       req.parallel_tool_calls is not False, response_schema(req), images)


def input_messages(items: list[dict], images: list[ImageSource] | None = None, image_marker: str = "") -> list[dict]:
    """Input items as chat messages; an item of a kind we do not serve is a 400 naming it."""
    out: list[dict] = []
    reasoning: list[str] = []  # reasoning items wait for the assistant turn they belong to
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ProtocolError(f"{where}: an input item must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, where, images, image_marker)
            if message["role"] == "assistant":
                _assistant(out, reasoning)["content"] += message["content"]
            else:
                out.append(message)
        elif kind == "reasoning":
            reasoning.append(_reasoning_text(item, where))
        elif kind in ("function_call", "custom_tool_call"):
            _assistant(out, reasoning).setdefault("tool_calls", []).append(_call(item, where, kind))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                        "content": _output_text(item.get("output"), f"{where}.output")})
        else:
            raise ProtocolError(f"{where}.type: {kind!r} items are not served here: send message, function_call, "
                                f"custom_tool_call, their outputs and reasoning items", f"{where}.type")
    return out


def _call(item: dict, where: str, kind: str) -> dict:
    """A function_call or custom_tool_call item as an assistant's tool call, under the name the model was offered."""
    name, namespace = item.get("name"), item.get("namespace")
    field_ = "input" if kind == "custom_tool_call" else "arguments"
    text = item.get(field_, "" if kind == "custom_tool_call" else "{}")
    if not isinstance(name, str) or not isinstance(text, str) or not isinstance(namespace, (str, type(None))):
        raise ProtocolError(f"{where}: a {kind} item needs 'name' and '{field_}' (a string); 'namespace', where "
                            f"given, is a string", where)
    if kind == "custom_tool_call":
        parsed = {CUSTOM_INPUT: text}
    else:
        try:
            parsed = json.loads(text or "{}")
        except ValueError as e:
            raise ProtocolError(f"{where}.arguments: not valid JSON: {e}", f"{where}.arguments") from None
    call_id = item.get("call_id") or item.get("id") or f"call_{uuid.uuid4().hex[:24]}"
    return {"id": call_id, "type": "function", "function": {"name": flat_name(name, namespace), "arguments": parsed}}


def _assistant(out: list[dict], reasoning: list[str]) -> dict:
    """The assistant message the next output item joins: the last one if nothing came after it, else a new one
    (carrying the reasoning items read since)."""
    if out and out[-1]["role"] == "assistant" and not reasoning:
        return out[-1]
    message = {"role": "assistant", "content": ""}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
        reasoning.clear()
    out.append(message)
    return message


def _message(item: dict, where: str, images: list[ImageSource] | None, image_marker: str) -> dict:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise ProtocolError(f"{where}.role: must be one of {', '.join(MESSAGE_ROLES)} (got {role!r})",
                            f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise ProtocolError(f"{where}.content: must be a string or a list of parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind == "input_image" and images is not None and isinstance(part.get("image_url"), str):
            images.append(ImageSource(f"{at}.image_url", part["image_url"]))
            texts.append(image_marker)
        elif kind == "input_image":
            raise ProtocolError(f"{at}: an input_image needs 'image_url' (a data: URL; file_id is not served)", at)
        else:
            raise ProtocolError(f"{at}: parts may be input_text, output_text, refusal or input_image, "
                                f"not {kind!r}", at)
    return {"role": role, "content": "".join(texts)}


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its reasoning_text content (what we send), else its summary."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise ProtocolError(f"{where}: a reasoning item's content and summary are lists of parts with 'text'", where)
    return "".join(p["text"] for p in parts)


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                        and isinstance(p.get("text"), str) for p in output):
        return "".join(p["text"] for p in output)
    raise ProtocolError(f"{where}: must be a string or a list of input_text parts", where)


def response_schema(req: ResponsesRequest) -> dict | None:
    """The JSON schema `text.format` holds the output to (json_object: any object), None for text."""
    fmt = (req.text.format if req.text else None) or {}
    return format_schema(fmt.get("type", "text"), fmt.get("schema"), "text.format")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    """The thinking as one reasoning item: the whole text as reasoning_text content. The parser has no summary of
    it, so `summary` stays empty rather than holding text that is not one."""
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text_part(text)]}


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_items(reasoning: str, text: str, calls: list[ToolCall], status: str, tools: ServedTools) -> list[dict]:
    """A finished output as items: reasoning, then the message (when there is text, or nothing else), then the
    calls (as the client's tools name them)."""
    items = [reasoning_item(new_id("rs"), reasoning)] if reasoning else []
    if text or not calls:
        items.append(message_item(new_id("msg"), text, status))
    items += [tools.call_item(new_id("fc"), c.id, c.name, c.arguments) for c in calls]
    return items


def sampling_params(req: ResponsesRequest, grammar: str | None) -> SamplingParams:
    """The engine's sampling settings for a Responses request (temperature and top_p default to 1)."""
    return SamplingParams(max_tokens=req.max_output_tokens, grammar=grammar,
                          temperature=1.0 if req.temperature is None else req.temperature,
                          top_p=1.0 if req.top_p is None else req.top_p)


def usage(counts: TokenCounts, reasoning_tokens: int) -> dict:
    """Responses usage; the cached tokens (of the input's) came from the prefix cache, which is written without a
    charge (cache_write_tokens 0)."""
    return {"input_tokens": counts.prompt_tokens,
            "input_tokens_details": {"cached_tokens": counts.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": counts.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": counts.prompt_tokens + counts.completion_tokens}


@dataclass(frozen=True)
class Meta:
    """What a response repeats of its request, in every lifecycle event and in the stored body."""

    id: str
    created_at: int
    model: str
    req: ResponsesRequest


def response_body(meta: Meta, output: list[dict], status: str, usage_: dict | None = None,
                  error: dict | None = None) -> dict:
    """The `response` object: its status, output items and usage, and the request settings it ran with."""
    req = meta.req
    tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
    fmt = (req.text.format if req.text else None) or {"type": "text"}
    reasoning = None
    if req.reasoning is not None:
        reasoning = {"effort": req.reasoning.effort, "summary": req.reasoning.summary}
    return {
        "id": meta.id, "object": "response", "created_at": meta.created_at, "status": status, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": meta.model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": reasoning, "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt}, "tool_choice": tool_choice, "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "usage": usage_,
        "metadata": req.metadata or {}, "user": req.user,
    }


def status_of(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def deleted_body(response_id: str) -> dict:
    return {"id": response_id, "object": "response.deleted", "deleted": True}
