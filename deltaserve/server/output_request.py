"""What a request asks of its output, checked one way for every API: a forced tool call (OpenAI's and Responses'
`tool_choice`, Anthropic's `tool_choice` any / tool) and a JSON-schema answer format (OpenAI's `response_format`,
Responses' `text.format`, Anthropic's `output_config.format`).

Each API's translator reads its own field shapes into these calls' arguments; the rules and their 400s live here.
What the chat step then makes of the result (the grammar, the output parser) is chat.py `chat_output`.
"""

from __future__ import annotations

from typing import Any

from deltaserve.server.protocol import ProtocolError

FORMAT_KINDS = ("text", "json_object", "json_schema")
ANY_OBJECT = {"type": "object"}  # what json_object asks for


def forced_tool(kind: str | None, name: str | None, tool_names: list[str], shown: str, *,
                name_param: str = "tool_choice.name", no_tools_note: str = "") -> tuple[str, str | None] | None:
    """("required", None) or ("named", name) when the request forces a call, None when it does not (`kind` None).

    `kind` is "required" or "named" as the API's translator read it; `tool_names` the tools the model is offered;
    `shown` the tool_choice as the client wrote it (for the message). Forcing with no tools, or naming a tool not
    offered, is a 400 naming tool_choice (`name_param` for the name; `no_tools_note` says why none are offered)."""
    if kind is None:
        return None
    if not tool_names:
        raise ProtocolError(f"tool_choice: {shown} needs a non-empty 'tools' list{no_tools_note}", "tool_choice")
    if kind == "required":
        return "required", None
    if name not in tool_names:
        raise ProtocolError(f"{name_param}: tool {name!r} is not among the tools "
                            f"({', '.join(map(str, tool_names))})", name_param)
    return "named", name


def format_schema(kind: str, schema: Any, field: str, kinds: tuple[str, ...] = FORMAT_KINDS,
                  schema_field: str | None = None) -> dict | None:
    """The JSON schema an answer format asks for: None for text, any object for json_object, `schema` for
    json_schema. A kind outside `kinds`, or a json_schema whose `schema` is not an object, is a 400 naming `field`
    (`schema_field` says where the schema goes)."""
    if kind not in kinds:
        raise ProtocolError(f"{field}.type: {kind!r} is not supported: choose {_choices(kinds)}", field)
    if kind == "text":
        return None
    if kind == "json_object":
        return dict(ANY_OBJECT)
    if not isinstance(schema, dict):
        raise ProtocolError(f"{schema_field or field + '.schema'}: a json_schema format needs a 'schema' object",
                            field)
    return schema


def _choices(kinds: tuple[str, ...]) -> str:
    return kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " or " + kinds[-1]
