"""The Responses API's `tools` in chat-template terms: what the model is offered, what its calls come back as.

Function tools are offered as they are. A `namespace` tool's functions are offered one by one under a flattened
name, `<namespace>.<function>` (the chat templates print a tool's name as a string, and a dot is not allowed in an
OpenAI function name, so a flattened name cannot be a plain function's); a call of one comes back as a
`function_call` item with `name` and `namespace` apart, as OpenAI sends it. A `custom` tool (free-form text input)
is offered as a function of one string argument, `input`; its call comes back as a `custom_tool_call` item. OpenAI's
built-in tools (the ones its service runs, or whose calls are item types of their own) are left out of what the
model sees and named in the response's DROPPED_TOOLS_HEADER; forcing one is a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from deltaserve.server import output_request
from deltaserve.server.protocol import ProtocolError

NAMESPACE_SEPARATOR = "."
DROPPED_TOOLS_HEADER = "X-Deltaserve-Dropped-Tools"
# OpenAI's built-in tool types: run by its service, or called through item types this server never writes.
BUILT_IN_TOOLS = ("web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
                  "file_search", "code_interpreter", "computer", "computer_use", "computer_use_preview",
                  "image_generation", "mcp", "tool_search", "programmatic_tool_calling", "local_shell", "shell",
                  "apply_patch")
SERVED_KINDS = ("function", "custom", "namespace")
CUSTOM_INPUT = "input"  # the one argument a custom tool is offered with
ANY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Origin:
    """What the client calls a tool the model sees under a flattened name."""

    name: str
    namespace: str | None = None
    custom: bool = False


@dataclass(frozen=True)
class ServedTools:
    """The request's tools as offered to the model (chat terms), the built-in ones left out, and where each
    offered name came from."""

    chat: list[dict] = field(default_factory=list)
    dropped: tuple[str, ...] = ()  # the built-in tools' types, in request order
    origins: dict[str, Origin] = field(default_factory=dict)  # flattened name -> the client's tool

    def call_item(self, item_id: str, call_id: str, flat_name: str, arguments: str, status: str = "completed") -> dict:
        """A call the model wrote, as the item the client knows: a function_call (with its namespace) or a
        custom_tool_call (its input taken out of the arguments)."""
        origin = self.origins.get(flat_name, Origin(flat_name))
        item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": origin.name,
                "arguments": arguments, "status": status}
        if origin.custom:
            item = {"id": item_id, "type": "custom_tool_call", "call_id": call_id, "name": origin.name,
                    "input": custom_input(arguments), "status": status}
        if origin.namespace:
            item["namespace"] = origin.namespace
        return item


def flat_name(name: str, namespace: str | None = None) -> str:
    """The name the model knows a (namespace's) tool by."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def custom_input(arguments: str) -> str:
    """A custom tool's free-form input out of the arguments the model wrote (all of them when not the one string)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed[CUSTOM_INPUT] if isinstance(parsed, dict) and isinstance(parsed.get(CUSTOM_INPUT), str) \
        else arguments


def served_tools(tools: list[dict] | None) -> ServedTools:
    """`tools` read and checked; a namespace with no tools, a name met twice once flattened or a type we do not
    know is a 400 naming `tools[i]`."""
    served = ServedTools()
    where_of: dict[str, str] = {}
    dropped = []
    for i, tool in enumerate(tools or []):
        where, kind = f"tools[{i}]", tool.get("type")
        if kind in BUILT_IN_TOOLS:
            dropped.append(kind)
            continue
        if kind not in SERVED_KINDS:
            raise ProtocolError(f"{where}.type: {kind!r} is not a tool type this server knows: send function, custom "
                                f"or namespace tools (OpenAI's built-in tools, e.g. web_search, are left out)",
                                f"{where}.type")
        if kind != "namespace":
            _offer(served, where_of, tool, where, None, "")
            continue
        namespace, inner = tool.get("name"), tool.get("tools")
        if not isinstance(namespace, str) or not namespace:
            raise ProtocolError(f"{where}.name: a namespace tool needs a name", f"{where}.name")
        if not isinstance(inner, list) or not inner:
            raise ProtocolError(f"{where}.tools: namespace {namespace!r} has no tools: it needs a non-empty list of "
                                f"function or custom tools", f"{where}.tools")
        preface = f"({namespace}: {tool['description']}) " if isinstance(tool.get("description"), str) else ""
        for j, member in enumerate(inner):
            at = f"{where}.tools[{j}]"
            if not isinstance(member, dict) or member.get("type") not in ("function", "custom"):
                kind = member.get("type") if isinstance(member, dict) else None
                raise ProtocolError(f"{at}.type: a namespace holds function or custom tools (got {kind!r})",
                                    f"{at}.type")
            _offer(served, where_of, member, at, namespace, preface)
    return ServedTools(served.chat, tuple(dropped), served.origins)


def _offer(served: ServedTools, where_of: dict[str, str], tool: dict, where: str, namespace: str | None,
           preface: str) -> None:
    """One function or custom tool added to what the model is offered."""
    name, custom = tool.get("name"), tool.get("type") == "custom"
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{where}.name: a {tool.get('type')} tool needs a name", f"{where}.name")
    flat = flat_name(name, namespace)
    if flat in where_of:
        raise ProtocolError(f"{where}.name: {flat!r} is also the name of {where_of[flat]}: tool names must differ "
                            f"(a namespace's functions are named '<namespace>{NAMESPACE_SEPARATOR}<function>')",
                            f"{where}.name")
    where_of[flat] = where
    description = preface + (tool.get("description") or "")
    if custom:
        parameters = {"type": "object", "additionalProperties": False, "required": [CUSTOM_INPUT],
                      "properties": {CUSTOM_INPUT: {"type": "string"}}}
        description = "\n".join(filter(None, (description, _custom_format(tool.get("format"), where))))
    else:
        parameters = tool.get("parameters") or ANY_PARAMETERS
        if not isinstance(parameters, dict):
            raise ProtocolError(f"{where}.parameters: must be a JSON schema object", f"{where}.parameters")
    served.chat.append({"type": "function", "function": {"name": flat, "description": description,
                                                         "parameters": parameters}})
    served.origins[flat] = Origin(name, namespace, custom)


def _custom_format(fmt: Any, where: str) -> str:
    """What a custom tool's input format tells the model (it is not enforced: the input is one free string)."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return f"Its '{CUSTOM_INPUT}' is free-form text."
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        return f"Its '{CUSTOM_INPUT}' follows this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
    raise ProtocolError(f"{where}.format: a custom tool's format is {{'type': 'text'}} or {{'type': 'grammar', "
                        f"'syntax': ..., 'definition': ...}}", f"{where}.format")


def forced_tool(choice: Any, served: ServedTools) -> tuple[str, str | None] | None:
    """("required", None) or ("named", flattened name) when tool_choice forces a call; None for auto / none. Forcing
    a built-in tool this server leaves out is a 400 naming it."""
    if choice is None or choice in ("auto", "none"):
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in BUILT_IN_TOOLS:
        raise ProtocolError(f"tool_choice: {kind!r} is a built-in tool of OpenAI's service, which this server does "
                            f"not run: it cannot be forced", "tool_choice")
    note = f" (only built-in tools this server does not run: {', '.join(served.dropped)})" if served.dropped else ""
    shown, offered = json.dumps(choice), list(served.origins)
    if choice == "required" or not served.chat:  # with no tools offered, any forced choice is the shared 400
        return output_request.forced_tool("required", None, offered, shown, no_tools_note=note)
    if kind not in ("function", "custom") or not isinstance(choice.get("name"), str):
        raise ProtocolError("tool_choice: must be 'none', 'auto', 'required' or {'type': 'function' or 'custom', "
                            f"'name': ...}} (got {shown[:80]})", "tool_choice")
    name, namespace = choice["name"], choice.get("namespace")
    flat = flat_name(name, namespace) if isinstance(namespace, str) else name
    if flat not in served.origins:  # a namespace's function may be named alone where no other has its name
        matches = [f for f, o in served.origins.items() if o.name == name and o.namespace]
        flat = matches[0] if len(matches) == 1 else flat
    return output_request.forced_tool("named", flat, offered, shown)
