"""One check for every API (server/output_request.py), read through each API's own translator without a model: a
forced tool call and a JSON-schema answer format come out the same whatever API asked, a bad one is the same 400
naming the API's own field; every API's stream events are framed by protocol.sse_event."""

import json

import pytest

from deltaserve.server import anthropic_stream, anthropic_translate, openai_translate, responses_translate
from deltaserve.server.anthropic_wire import MessagesRequest
from deltaserve.server.openai_wire import ChatCompletionRequest
from deltaserve.server.protocol import ProtocolError, sse_event
from deltaserve.server.responses_stream import ItemStream
from deltaserve.server.responses_tools import ServedTools
from deltaserve.server.responses_wire import ResponsesRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
FUNCTION = {"name": "run", "parameters": {"type": "object", "properties": {}}}


def openai_chat(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return openai_translate.to_chat(openai_translate.parse_request(ChatCompletionRequest, body), "")


def anthropic_chat(**fields):
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **fields}
    return anthropic_translate.to_chat(anthropic_translate.parse(MessagesRequest, body))


def responses_chat(**fields):
    req = responses_translate.parse(ResponsesRequest, {"model": "m", "input": "hi", **fields})
    return responses_translate.to_chat(req, responses_translate.input_items(req))


def test_every_api_forces_a_named_call_the_same_way():
    chats = [openai_chat(tools=[{"type": "function", "function": FUNCTION}],
                         tool_choice={"type": "function", "function": {"name": "run"}}),
             anthropic_chat(tools=[{"name": "run", "input_schema": FUNCTION["parameters"]}],
                            tool_choice={"type": "tool", "name": "run"}),
             responses_chat(tools=[{"type": "function", **FUNCTION}], tool_choice={"type": "function", "name": "run"})]
    assert [(c.tool_choice, c.forced_name) for c in chats] == [("named", "run")] * 3
    required = [openai_chat(tools=[{"type": "function", "function": FUNCTION}], tool_choice="required"),
                anthropic_chat(tools=[{"name": "run", "input_schema": {}}], tool_choice={"type": "any"}),
                responses_chat(tools=[{"type": "function", **FUNCTION}], tool_choice="required")]
    assert [(c.tool_choice, c.forced_name) for c in required] == [("required", None)] * 3


@pytest.mark.parametrize("make, fields, param", [
    (openai_chat, {"tool_choice": "required"}, "tool_choice"),
    (anthropic_chat, {"tool_choice": {"type": "any"}}, "tool_choice"),
    (responses_chat, {"tool_choice": "required"}, "tool_choice"),
])
def test_forcing_without_tools_is_the_same_400(make, fields, param):
    with pytest.raises(ProtocolError, match="needs a non-empty 'tools' list") as e:
        make(**fields)
    assert e.value.param == param


@pytest.mark.parametrize("make, fields, param", [
    (openai_chat, {"tools": [{"type": "function", "function": FUNCTION}],
                   "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    (anthropic_chat, {"tools": [{"name": "run", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name"),
    (responses_chat, {"tools": [{"type": "function", **FUNCTION}], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
])
def test_forcing_an_unknown_tool_names_the_tools(make, fields, param):
    with pytest.raises(ProtocolError, match=r"tool 'nope' is not among the tools \(run\)") as e:
        make(**fields)
    assert e.value.param == param


def test_every_api_asks_for_the_same_schema():
    assert openai_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
                       ).response_schema == SCHEMA
    assert anthropic_chat(output_config={"format": {"type": "json_schema", "schema": SCHEMA}}).response_schema == SCHEMA
    assert responses_chat(text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}
                          ).response_schema == SCHEMA
    assert openai_chat(response_format={"type": "json_object"}).response_schema == {"type": "object"}
    assert responses_chat(text={"format": {"type": "json_object"}}).response_schema == {"type": "object"}
    assert openai_chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}).response_schema == \
        {"type": "object"}  # OpenAI's json_schema without a schema: any object
    assert openai_chat(response_format={"type": "text"}).response_schema is None
    assert responses_chat().response_schema is None


@pytest.mark.parametrize("make, fields, param", [
    (openai_chat, {"response_format": {"type": "yaml"}}, "response_format"),
    (anthropic_chat, {"output_config": {"format": {"type": "yaml"}}}, "output_config.format"),
    (responses_chat, {"text": {"format": {"type": "yaml"}}}, "text.format"),
])
def test_an_unknown_format_is_the_same_400(make, fields, param):
    with pytest.raises(ProtocolError, match=rf"{param}.type: 'yaml' is not supported: choose .*json_schema") as e:
        make(**fields)
    assert e.value.param == param


def test_every_stream_is_framed_by_one_function():
    body = {"type": "ping", "text": "é"}
    assert anthropic_stream.event("ping", body) == sse_event(body, "ping") == \
        f"event: ping\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()
    responses = ItemStream(ServedTools()).event("response.created", text="é")
    assert responses == sse_event({"type": "response.created", "sequence_number": 0, "text": "é"}, "response.created")
    assert sse_event(body) == b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"
