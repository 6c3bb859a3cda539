"""Anthropic's Messages API in engine terms: a request as the shared chat step's ChatRequest (server/chat.py) and
its SamplingParams, and engine outputs as the response body, its stop reason and usage.

Only this module, anthropic_wire.py and anthropic_stream.py (the stream events) know Anthropic's field names; the
routes in anthropic.py hand them engine outputs.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import ValidationError

from deltaserve.engine.request import SamplingParams
from deltaserve.images import ImageSource, data_url
from deltaserve.server.anthropic_wire import Block, MessagesRequest, _Body
from deltaserve.server.chat import ChatRequest
from deltaserve.server.output_request import forced_tool, format_schema
from deltaserve.server.protocol import ProtocolError, validation_message
from deltaserve.text.tool_parsers import ToolCall

BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's first system line (see _system_text)


def parse(model: type[_Body], body: Any) -> MessagesRequest:
    """Validate a decoded body; a problem becomes a ProtocolError naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise ProtocolError(*validation_message(e)) from None


def to_chat(req: MessagesRequest, image_marker: str | None = None) -> ChatRequest:
    """System, messages (tool results become tool messages), tools and tool_choice in OpenAI chat terms.

    A system message among the messages stays a system message where it stands; the shared chat step
    (chat.template_messages) places it where the template cannot render it there.

    With `image_marker` (the model's; "" where it takes no images, which the door then refuses), each image block of
    a user turn becomes the marker in its text and its source is listed in the chat's `images`; without, image
    blocks are refused (count_tokens)."""
    images: list[ImageSource] | None = [] if image_marker is not None else None
    messages = []
    system = _system_text(req.system) if req.system else ""
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        if message.role == "system":
            messages.append({"role": "system", "content": _text_of(message.content, f"messages[{i}].content")})
            continue
        blocks = [Block(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        messages += (_user_messages(blocks, i, images, image_marker or "") if message.role == "user"
                     else [_assistant_message(blocks, i)])
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in req.tools or []] or None
    choice, name = "auto", None
    if req.tool_choice is not None:
        kind = {"any": "required", "tool": "named"}.get(req.tool_choice.type)
        forced = forced_tool(kind, req.tool_choice.name, [t.name for t in req.tools or []],
                             repr(req.tool_choice.type))
        choice, name = forced or ("none" if req.tool_choice.type == "none" else "auto", req.tool_choice.name)
    kwargs: dict = {"tools": tools} if tools else {}
    thinking = _thinking(req)
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    parallel = not (req.tool_choice and req.tool_choice.disable_parallel_tool_use)
    return ChatRequest(messages, tools, kwargs, choice, name, parallel, response_schema=_output_schema(req),
                       images=images or [])


def _system_text(system: str | list[Block]) -> str:
    """The system prompt less Claude Code's first line, `x-anthropic-billing-header: cc_version=...;
    cc_entrypoint=...;`: a stamp that changes between versions, entry points and requests, and at the top of the
    prompt would leave the prefix cache nothing to share between them (llama.cpp strips it too)."""
    if isinstance(system, str):
        return _unstamped(system)
    blocks = list(system)
    if blocks and blocks[0].type == "text" and blocks[0].text is not None:
        first = _unstamped(blocks[0].text)
        blocks = ([blocks[0].model_copy(update={"text": first})] if first else []) + blocks[1:]
    return _text_of(blocks, "system")


def _unstamped(text: str) -> str:
    return text.partition("\n")[2] if text.startswith(BILLING_HEADER) else text


def _thinking(req: MessagesRequest) -> bool | None:
    """The template's thinking switch: on for enabled, off for disabled, on for adaptive unless the effort is low
    (at low effort Claude skips thinking where it can); None leaves the template's default."""
    if req.thinking is None:
        return None
    effort = req.output_config.effort if req.output_config else None
    return req.thinking.type == "enabled" or (req.thinking.type == "adaptive" and effort != "low")


def _output_schema(req: MessagesRequest) -> dict | None:
    """output_config.format's JSON schema (Anthropic's structured outputs), which the grammar holds the answer to."""
    fmt = req.output_config.format if req.output_config else None
    if fmt is None:
        return None
    return format_schema(fmt.get("type"), fmt.get("schema"), "output_config.format", kinds=("json_schema",))


def _text_of(content: str | list[Block], where: str) -> str:
    if isinstance(content, str):
        return content
    for j, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise ProtocolError(f"{where}[{j}]: only text blocks are supported here, not {block.type!r}",
                                f"{where}[{j}]")
    return "".join(block.text for block in content)


def _user_messages(blocks: list[Block], i: int, images: list[ImageSource] | None = None,
                   image_marker: str = "") -> list[dict]:
    """Tool results become tool messages (first, as they answer the previous turn), text the user's message."""
    out, texts = [], []
    for j, block in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if block.type == "image" and images is not None:
            images.append(ImageSource(f"{where}.source", _image_url(block, where)))
            texts.append(image_marker)
        elif block.type == "tool_result":
            content = _text_of(block.content or "", f"{where}.content")
            out.append({"role": "tool", "tool_call_id": block.tool_use_id or "",
                        "content": ("Error: " + content) if block.is_error else content})
        elif block.type == "text" and block.text is not None:
            texts.append(block.text)
        else:
            raise ProtocolError(f"{where}: a user turn may hold text and tool_result blocks, not {block.type!r}",
                                where)
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _image_url(block: Block, where: str) -> str:
    source = block.source
    if source is None:
        raise ProtocolError(f"{where}: an image block needs a 'source'", f"{where}.source")
    if source.type == "base64" and source.data is not None:
        return data_url(source.media_type or "application/octet-stream", source.data)
    if source.type == "url" and source.url:
        return source.url  # refused when read: the server fetches nothing
    raise ProtocolError(f"{where}.source: only base64 image sources (with 'data') are served, not {source.type!r}",
                        f"{where}.source")


def _assistant_message(blocks: list[Block], i: int) -> dict:
    """An earlier assistant turn: its thinking as reasoning_content, its tool_use blocks as tool_calls."""
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type in ("thinking", "redacted_thinking"):
            reasoning.append(block.thinking or "")
        elif block.type == "tool_use" and block.name:
            calls.append({"id": block.id or f"toolu_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": block.name, "arguments": block.input or {}}})
        else:
            where = f"messages[{i}].content[{j}]"
            raise ProtocolError(f"{where}: an assistant turn may hold text, thinking and tool_use blocks, "
                                f"not {block.type!r}", where)
    message = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def sampling_params(req: MessagesRequest, grammar: str | None) -> SamplingParams:
    """The engine's sampling settings for a Messages request."""
    return SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p or 1.0,
                          top_k=req.top_k or 0, stop=tuple(s for s in req.stop_sequences or () if s),
                          grammar=grammar)


def stop_reason(finish: str | None, called: bool, stop_sequence: str | None) -> str:
    """Anthropic's stop_reason for the engine's finish."""
    if finish == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop_sequence else "end_turn"


def stop_sequence(stop: str | int | None) -> str | None:
    """The stop sequence that ended the output, as the engine matched it (a stop token id is no sequence)."""
    return stop if isinstance(stop, str) else None


def usage(prompt_tokens: int, cached_tokens: int, speculative: dict | None = None) -> dict:
    """Anthropic's input counts: `input_tokens` are the prompt tokens read, `cache_read_input_tokens` those the
    prefix cache supplied (their sum is the prompt); the cache is written without a charge. `speculative`
    ({drafted, accepted} draft tokens, --speculative; an extension, as in our OpenAI usage): only when speculating."""
    out = {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
           "cache_read_input_tokens": cached_tokens}
    if speculative is not None:
        out["speculative"] = {"drafted": speculative["drafted"], "accepted": speculative["accepted"]}
    return out


def message_body(msg_id: str, model: str, reasoning: str, text: str, calls: list[ToolCall], reason: str,
                 stop_sequence: str | None, input_tokens: int, output_tokens: int, cached_tokens: int = 0,
                 speculative: dict | None = None) -> dict:
    """The non-streamed response; `input_tokens` counts the whole prompt, `cached_tokens` of it came from the
    prefix cache; `speculative`: the request's draft counts where the server speculates."""
    content = []
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text or not calls:
        content.append({"type": "text", "text": text})
    content += [{"type": "tool_use", "id": tool_id(c.id), "name": c.name, "input": json.loads(c.arguments)}
                for c in calls]
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": {**usage(input_tokens, cached_tokens, speculative), "output_tokens": output_tokens}}


def tool_id(call_id: str) -> str:
    """A call's id as Anthropic writes tool_use ids."""
    return "toolu_" + call_id.removeprefix("call_")
