"""Structured output: the JSON schemas that forced tool calls and response_format constrain the output to.

tool_choice "required" makes the model write a JSON array of calls `[{"name": ..., "arguments": {...}}]`; a
named tool_choice makes it write that function's arguments object. Either way the grammar guarantees the
output parses and the arguments validate against the tool's schema, whatever the chat template's own format.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import llguidance

from deltaserve.text.tool_parsers import ToolCall, new_call_id, tool_schemas

ANY_OBJECT = {"type": "object"}


def schema_grammar(schema: dict) -> str:
    """llguidance's grammar for a JSON schema, compact (no free whitespace: a model cannot pad forever)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except ValueError as e:
        raise ValueError(f"not a usable JSON schema: {e}") from None


def required_calls_schema(tools: list[dict]) -> dict:
    """A non-empty array of calls of any of `tools`, each with arguments valid for its function."""
    variants = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                 "properties": {"name": {"const": name}, "arguments": params or ANY_OBJECT}}
                for name, params in tool_schemas(tools).items()]
    return {"type": "array", "minItems": 1, "items": {"anyOf": variants}}


def named_call_schema(tools: list[dict], name: str) -> dict:
    """The arguments object of function `name`; KeyError when no tool has that name."""
    return tool_schemas(tools)[name] or ANY_OBJECT


def forced_calls(text: str, name: str | None, make_id: Callable[[], str] = new_call_id) -> list[ToolCall]:
    """The calls in a grammar-forced output: the arguments of `name`, or (name None) an array of calls."""
    value = json.loads(text)
    if name is not None:
        return [ToolCall(make_id(), name, json.dumps(value, ensure_ascii=False))]
    return [ToolCall(make_id(), call["name"], json.dumps(call["arguments"], ensure_ascii=False)) for call in value]
