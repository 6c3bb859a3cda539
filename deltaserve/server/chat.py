"""The chat-preparation step every chat API shares: a ChatRequest in, the prompt ids, message boundaries, prepared
images and output settings out, each made once.

A chat route (OpenAI's chat completions, Anthropic's Messages, and any API to come) translates its request into a
ChatRequest: the messages as the chat template reads them (an image as the model's image marker, its source listed
in `images`), the template's variables, and what is asked of the output (tools, tool_choice, a response schema).
`prepare_chat` reads the images through the engine's door (engine/door.py `prepare_images`), renders and encodes
the chat (text/tokenizer.py), and says how the output is read back and held (text/: reasoning, the family's
tool-call parser, a forced call's grammar). The route then submits (generation.py `submit`).
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field

from deltaserve.config import EngineConfig
from deltaserve.engine.door import Refused, prepare_images
from deltaserve.engine.engine import Engine
from deltaserve.images import ImageSource, PreparedImage
from deltaserve.server.state import ApiError, ServerState, refused_error
from deltaserve.text.chat_output import ChatOutputSettings
from deltaserve.text.reasoning import THINK_CLOSE, prompt_opens_thinking, template_reasons
from deltaserve.text.structured import named_call_schema, required_calls_schema, schema_grammar
from deltaserve.text.tokenizer import ChatTemplateError, Tokenizer
from deltaserve.text.tool_parsers import pick_tool_parser

PROMPT_TAIL_TOKENS = 4  # enough of the prompt's end to see whether it opens a <think> block
LATER_SYSTEM_MARK = "later system message"  # what the probe of a template looks for in its rendering
LATER_SYSTEM_PROBE = ({"role": "system", "content": "first"}, {"role": "user", "content": "question"},
                      {"role": "system", "content": LATER_SYSTEM_MARK}, {"role": "user", "content": "question"})


@dataclass
class ChatRequest:
    """A chat as the template wants it, whatever API it came by, and what it asks of the output."""

    messages: list[dict]
    tools: list[dict] | None = None
    template_kwargs: dict = field(default_factory=dict)  # `tools`, and whatever else the template reads
    tool_choice: str = "auto"  # auto | none | required | named
    forced_name: str | None = None  # the tool a "named" choice forces
    parallel: bool = True  # False: one call per turn
    response_schema: dict | None = None  # the JSON schema the answer must follow
    images: list[ImageSource] = field(default_factory=list)  # in the order their markers stand in `messages`
    add_generation_prompt: bool = True


@dataclass
class PreparedChat:
    """A chat ready to submit: its prompt, where its messages end, its images, and how its output is read and held."""

    prompt_ids: list[int]
    boundaries: list[int]  # the prefix cache keeps GDN checkpoints there
    images: list[PreparedImage]
    settings: ChatOutputSettings
    grammar: str | None
    reasoning_end: tuple[int, ...] = ()  # `</think>`'s ids when the output is split into reasoning, else ()


async def prepare_chat(state: ServerState, engine: Engine, chat: ChatRequest) -> PreparedChat:
    """Images read, the chat templated and encoded (both in the thread pool), the output settings chosen; any
    problem is a 400 naming the field."""
    images = []
    if chat.images:  # a text chat skips the thread hop
        try:
            images = await asyncio.to_thread(prepare_images, engine.info, chat.images,
                                             state.config.allowed_local_media_path)
        except Refused as e:
            raise refused_error(e) from None
    prompt_ids, boundaries = await asyncio.to_thread(chat_ids, engine, chat.messages, chat.add_generation_prompt,
                                                     chat.template_kwargs)
    try:
        settings, grammar = chat_output(state.config, engine.tokenizer, prompt_ids, tools=chat.tools,
                                        tool_choice=chat.tool_choice, forced_name=chat.forced_name,
                                        response_schema=chat.response_schema, parallel=chat.parallel)
    except OutputRequestError as e:
        raise ApiError(400, e.message, param=e.param) from None
    thinks = settings.reasoning and not settings.forced
    reasoning_end = tuple(engine.tokenizer.encode(THINK_CLOSE, False)) if thinks else ()
    return PreparedChat(prompt_ids, boundaries, images, settings, grammar, reasoning_end)


def encode_chat(engine: Engine, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> list[int]:
    """The chat's prompt ids (/tokenize, count_tokens); a template that refuses the client's data is a 400."""
    return chat_ids(engine, messages, add_generation_prompt, kwargs, with_boundaries=False)[0]


def chat_ids(engine: Engine, messages: list[dict], add_generation_prompt: bool, kwargs: dict,
             with_boundaries: bool = True) -> tuple[list[int], list[int]]:
    """(the chat's prompt ids, where its messages end: the prefix cache keeps checkpoints there)."""
    try:
        return engine.tokenizer.encode_chat_boundaries(
            template_messages(engine.tokenizer, messages), add_generation_prompt,
            with_boundaries=with_boundaries and engine.info.prefix_cache, **kwargs)
    except ChatTemplateError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    except Exception as e:  # the template ran on the client's data (messages, tools, chat_template_kwargs)
        raise ApiError(400, f"messages: the chat template failed on this request: {type(e).__name__}: {e}",
                       param="messages") from None


def template_messages(tokenizer: Tokenizer, messages: list[dict]) -> list[dict]:
    """The messages as this chat template can render them.

    A `developer` message (OpenAI's newer name for a system message) is a system message where the template knows no
    developer role: such templates drop it without a word. A system message after the first stays in place where
    the template renders it there (Qwen3's does); where it cannot (Qwen3.5's raises), system messages before any
    other join the first, and a later one joins the end of the user turn it follows, or becomes a user turn of its
    own after an assistant or tool turn. Its place never depends on what comes after it, so a conversation that
    grows keeps its prompt's prefix, and its prefix-cache hits."""
    template = tokenizer.chat_template or ""
    if "developer" not in template:
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    if all(m.get("role") != "system" for m in messages[1:]) or _renders_later_system(tokenizer, template):
        return messages
    out: list[dict] = []
    for message in messages:
        text = message.get("content")
        if message.get("role") != "system" or not out or not isinstance(text, str):
            out.append(message)
            continue
        last = out[-1]
        leading = all(m.get("role") == "system" for m in out)
        if (leading or last.get("role") == "user") and isinstance(last.get("content"), str):
            out[-1] = {**last, "content": f"{last['content']}\n\n{text}" if last["content"] else text}
        else:
            out.append({"role": "user", "content": text})
    return out


@functools.lru_cache(maxsize=8)
def _renders_later_system(tokenizer: Tokenizer, template: str) -> bool:
    """Whether the template renders a system message after the first one, in place (asked once per template)."""
    try:
        return LATER_SYSTEM_MARK in tokenizer.apply_chat_template(list(LATER_SYSTEM_PROBE))
    except Exception:  # the template refuses it (raise_exception) or fails on it: fold instead
        return False


class OutputRequestError(ValueError):
    """A schema or tool choice that cannot be served; the message names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


def tool_parser_name(config: EngineConfig, chat_template: str | None) -> str | None:
    """The tool-call parser of this server: the setting, or (auto) the one the chat template's format needs."""
    if config.tool_call_parser == "auto":
        return pick_tool_parser(chat_template)
    return None if config.tool_call_parser == "none" else config.tool_call_parser


def reasons(config: EngineConfig, chat_template: str | None) -> bool:
    """Whether outputs are split into reasoning and answer."""
    if config.reasoning_parser == "auto":
        return template_reasons(chat_template)
    return config.reasoning_parser == "think"


def chat_output(config: EngineConfig, tokenizer: Tokenizer, prompt_ids: list[int], *, tools: list[dict] | None,
                tool_choice: str, forced_name: str | None = None,
                response_schema: dict | None = None,
                parallel: bool = True) -> tuple[ChatOutputSettings, str | None]:
    """(how to read the output, the grammar to hold it to or None).

    `tool_choice` is "auto", "none", "required" or "named" (with `forced_name`); `response_schema` is the
    JSON schema of response_format; `parallel` False allows one call per turn. A forced output is JSON from its first token, so it is not split into
    reasoning.
    """
    schema, forced = response_schema, None
    if tools and tool_choice in ("required", "named"):
        forced = tool_choice
        schema = required_calls_schema(tools, parallel) if forced == "required" else \
            named_call_schema(tools, forced_name)
    grammar = None
    if schema is not None:
        try:
            grammar = schema_grammar(schema)
        except ValueError as e:
            raise OutputRequestError(str(e), "tools" if forced else "response_format") from None
    thinking = reasons(config, tokenizer.chat_template) and grammar is None
    tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    parser = tool_parser_name(config, tokenizer.chat_template) if tools and tool_choice == "auto" else None
    settings = ChatOutputSettings(reasoning=thinking, in_reasoning=thinking and prompt_opens_thinking(tail),
                                  tool_parser=parser, tools=tuple(tools or ()), forced=forced,
                                  forced_name=forced_name)
    return settings, grammar
