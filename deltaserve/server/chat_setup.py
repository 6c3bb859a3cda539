"""What a chat request asks of its output, in engine and text terms: the grammar it is held to, and how its
text is read back (reasoning, the family's tool-call parser, or a forced call). Shared by the OpenAI and
Anthropic routes."""

from __future__ import annotations

from deltaserve.config import EngineConfig
from deltaserve.text.chat_output import ChatOutputSettings
from deltaserve.text.reasoning import prompt_opens_thinking, template_reasons
from deltaserve.text.structured import named_call_schema, required_calls_schema, schema_grammar
from deltaserve.text.tokenizer import Tokenizer
from deltaserve.text.tool_parsers import pick_tool_parser

PROMPT_TAIL_TOKENS = 4  # enough of the prompt's end to see whether it opens a <think> block


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
