"""Structured output: the JSON schemas that forced tool calls and response_format constrain the output to.

tool_choice "required" makes the model write a JSON array of calls `[{"name": ..., "arguments": {...}}]`; a
named tool_choice makes it write that function's arguments object. Either way the grammar guarantees the
output parses and the arguments validate against the tool's schema, whatever the chat template's own format.
"""

from __future__ import annotations

import llguidance

from deltaserve.text.tool_parsers import tool_schemas

ANY_OBJECT = {"type": "object"}


def schema_grammar(schema: dict) -> str:
    """llguidance's grammar for a JSON schema, compact (no free whitespace: a model cannot pad forever)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except ValueError as e:
        raise ValueError(f"not a usable JSON schema: {e}") from None


def required_calls_schema(tools: list[dict], parallel: bool = True) -> dict:
    """A non-empty array of calls of any of `tools` (one call when not `parallel`), each with valid arguments."""
    variants = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                 "properties": {"name": {"const": name}, "arguments": params or ANY_OBJECT}}
                for name, params in tool_schemas(tools).items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    return schema if parallel else {**schema, "maxItems": 1}


def named_call_schema(tools: list[dict], name: str) -> dict:
    """The arguments object of function `name`; KeyError when no tool has that name."""
    return tool_schemas(tools)[name] or ANY_OBJECT
