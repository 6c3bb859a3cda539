"""OpenAI's Responses API (`POST /v1/responses`, what Codex CLI speaks) against a real server: the built-in SmolLM2
with Qwen3's chat template (hermes tool calls, <think> blocks), as in test_server_agents.py, driven by the official
`openai` package. Every body and every streamed event is also validated by the package's own pydantic types (the
client itself builds them unchecked), and the prompt the server renders is compared with what its chat route
renders for the same conversation (/tokenize): the count the Responses usage reports must be that prompt's.
"""

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from deltaserve.server.response_store import ResponseStore
from server_util import SMALL_POOL, assert_openai_error, running_server

TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "qwen3.jinja"
READ_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["path", "line"], "properties": {
    "path": {"type": "string", "maxLength": 24}, "line": {"type": "integer", "minimum": 1, "maximum": 999}}}
TOOLS = [{"type": "function", "name": "read_file", "description": "Read a line of a file", "parameters": READ_SCHEMA},
         {"type": "function", "name": "run", "description": "Run a shell command", "parameters": {
             "type": "object", "required": ["command"], "additionalProperties": False,
             "properties": {"command": {"type": "string", "maxLength": 30}}}}]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["parameters"]}} for t in TOOLS]
EVENTS = TypeAdapter(ResponseStreamEvent)
# A namespace as Codex sends its sub-agent tools; its `run` shares a name with a plain function, told apart.
SPAWN_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["message"],
                "properties": {"message": {"type": "string", "maxLength": 20}}}
NAMESPACE = {"type": "namespace", "name": "ns", "description": "Tools for sub-agents.", "tools": [
    {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent", "parameters": SPAWN_SCHEMA},
    {"type": "function", "name": "run", "description": "Run in a sub-agent", "parameters": TOOLS[1]["parameters"]}]}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch"}
HOSTED = [{"type": "web_search", "external_web_access": False}, {"type": "file_search", "vector_store_ids": ["v"]},
          {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "image_generation"},
          {"type": "mcp", "server_label": "x", "server_url": "https://example.invalid"},
          {"type": "computer_use_preview", "display_width": 8, "display_height": 8, "environment": "linux"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("responses"), *SMALL_POOL, "--chat-template", str(TEMPLATE)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def prompt_tokens(server, messages: list[dict], **extra) -> int:
    """What the chat route renders for `messages` (the same template, tools and switches): the oracle."""
    answer = server.post("/tokenize", json={"messages": messages, **extra})
    assert answer.status_code == 200, answer.text
    return answer.json()["count"]


def raw_events(server, body: dict) -> list:
    """A streamed response's events as sent, each validated by the openai package's own event types."""
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=300,
                      trust_env=False) as answer:
        assert answer.status_code == 200
        text = "".join(answer.iter_text())
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_text_answer_parses_and_counts_the_prompt(client, server):
    reply = client.responses.create(model="SmolLM2-135M-Instruct", instructions="Be brief.", input="Name a colour.",
                                    max_output_tokens=12, temperature=0)
    Response.model_validate(reply.model_dump())
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.status in ("completed", "incomplete")
    assert [item.type for item in reply.output] == ["message"] and reply.output_text
    assert reply.usage.input_tokens == prompt_tokens(server, [{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Name a colour."}])
    assert 0 < reply.usage.output_tokens <= 12
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens" and reply.usage.output_tokens == 12


def test_stream_events_in_order_and_equal_to_the_whole(client, server):
    body = {"input": "Say hello.", "max_output_tokens": 10, "temperature": 0}
    events = raw_events(server, body)
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-4:-1] == tail and kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output[0].content[0].text == text == events[-4].text
    whole = client.responses.create(model="SmolLM2-135M-Instruct", **body)
    assert whole.output_text == text and whole.usage.output_tokens == final.usage.output_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: the prefix cache supplied it
    assert final.status == ("incomplete" if kinds[-1] == "response.incomplete" else "completed")
    with client.responses.stream(model="SmolLM2-135M-Instruct", **body) as stream:
        assert [e.type for e in stream] == kinds  # the SDK's own accumulator took every event
        if final.status == "completed":  # the helper's final response comes with response.completed only
            assert stream.get_final_response().output_text == text


def test_forced_call_multi_turn_and_stored_conversation(client, server):
    """A named call (whole), its output sent back, a required call streamed through the SDK helper, then a plain
    answer through previous_response_id: the rendered prompt is always what the chat route renders for the same
    conversation, and the stored one is the same conversation sent whole."""
    ask = [{"role": "user", "content": "Show me line 3 of setup.py."}]
    first = client.responses.create(model="SmolLM2-135M-Instruct", input=ask, tools=TOOLS, max_output_tokens=80,
                                    temperature=0, tool_choice={"type": "function", "name": "read_file"})
    Response.model_validate(first.model_dump())
    [call] = first.output
    assert call.type == "function_call" and call.name == "read_file" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), READ_SCHEMA)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "x = 3"}
    history = ask + [call.model_dump(exclude_none=True), result]
    with client.responses.stream(model="SmolLM2-135M-Instruct", input=history, tools=TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=80, temperature=0) as stream:
        kinds = [e.type for e in stream]
        second = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    [call2] = second.output
    assert call2.type == "function_call" and call2.name in ("read_file", "run")
    chat = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "read_file",
                                                              "arguments": json.loads(call.arguments)}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "x = 3"}]
    assert second.usage.input_tokens == prompt_tokens(server, chat, tools=CHAT_TOOLS)
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt was kept

    follow = client.responses.create(model="SmolLM2-135M-Instruct", previous_response_id=second.id, tools=TOOLS,
                                     input=[{"type": "function_call_output", "call_id": call2.call_id,
                                             "output": "ok"}], max_output_tokens=8, temperature=0)
    whole = client.responses.create(model="SmolLM2-135M-Instruct", tools=TOOLS, store=False, max_output_tokens=8,
                                    temperature=0, input=history + [call2.model_dump(exclude_none=True), {
                                        "type": "function_call_output", "call_id": call2.call_id, "output": "ok"}])
    assert follow.previous_response_id == second.id
    assert follow.usage.input_tokens == whole.usage.input_tokens and follow.output_text == whole.output_text
    assert client.responses.retrieve(follow.id).model_dump() == follow.model_dump()
    client.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError, match="not in this server's response store"):
        client.responses.retrieve(follow.id)
    with pytest.raises(openai.BadRequestError, match="--responses-store-bytes"):
        client.responses.create(model="SmolLM2-135M-Instruct", previous_response_id=whole.id, input="again")


def offered(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


# What the model must be offered for TOOLS + [NAMESPACE, PATCH] + HOSTED, written out: the namespace's functions under
# `ns.<name>`, the custom tool as a function of one string, no built-in tool.
OFFERED = CHAT_TOOLS + [
    offered("ns.spawn_agent", "(ns: Tools for sub-agents.) Start a sub-agent", SPAWN_SCHEMA),
    offered("ns.run", "(ns: Tools for sub-agents.) Run in a sub-agent", TOOLS[1]["parameters"]),
    offered("apply_patch", "Apply a patch\nIts 'input' is free-form text.", {
        "type": "object", "additionalProperties": False, "required": ["input"],
        "properties": {"input": {"type": "string"}}})]


def test_namespace_custom_and_built_in_tools(client, server):
    """Codex's tool list in miniature: function tools, a namespace, a custom tool and OpenAI's built-in tools. The
    built-in ones are left out of the prompt and named in the header; a forced namespace call comes back (whole and
    streamed alike) as a function_call item carrying `namespace`, its output goes back into the conversation, and
    previous_response_id keeps it; a forced custom call comes back as a custom_tool_call with free-form input."""
    ask = [{"role": "user", "content": "Start a helper."}]
    body = {"model": "SmolLM2-135M-Instruct", "input": ask, "tools": TOOLS + [NAMESPACE, PATCH] + HOSTED,
            "max_output_tokens": 60, "temperature": 0,
            "tool_choice": {"type": "function", "name": "spawn_agent", "namespace": "ns"}}
    answer = server.post("/v1/responses", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-deltaserve-dropped-tools"] == ", ".join(t["type"] for t in HOSTED)
    first = Response.model_validate(answer.json())
    [call] = first.output
    assert (call.type, call.name, call.namespace) == ("function_call", "spawn_agent", "ns")
    jsonschema.validate(json.loads(call.arguments), SPAWN_SCHEMA)
    assert first.usage.input_tokens == prompt_tokens(server, ask, tools=OFFERED)

    events = raw_events(server, body)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.type, i.name, i.namespace) for i in added] == [("function_call", "spawn_agent", "ns")]
    [streamed] = events[-1].response.output  # its own greedy run: a prefix-cache hit may round differently
    assert (streamed.type, streamed.name, streamed.namespace) == ("function_call", "spawn_agent", "ns")
    jsonschema.validate(json.loads(streamed.arguments), SPAWN_SCHEMA)
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [streamed.arguments]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == streamed.arguments

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "agent 7 started"}
    follow = client.responses.create(model="SmolLM2-135M-Instruct", previous_response_id=first.id, input=[result],
                                     tools=TOOLS + [NAMESPACE, PATCH] + HOSTED, max_output_tokens=4, temperature=0)
    chat = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "ns.spawn_agent",
                                                              "arguments": json.loads(call.arguments)}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "agent 7 started"}]
    assert follow.usage.input_tokens == prompt_tokens(server, chat, tools=OFFERED)
    assert follow.usage.input_tokens_details.cached_tokens > 0

    custom = {**body, "tool_choice": {"type": "custom", "name": "apply_patch"}}
    whole = Response.model_validate(server.post("/v1/responses", json=custom).json())
    [patch] = whole.output
    assert patch.type == "custom_tool_call" and patch.name == "apply_patch" and isinstance(patch.input, str)
    events = raw_events(server, custom)
    [streamed] = events[-1].response.output
    assert (streamed.type, streamed.name) == ("custom_tool_call", "apply_patch")
    done = [e.input for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done == [streamed.input] == ["".join(e.delta for e in events
                                                if e.type == "response.custom_tool_call_input.delta")]
    sent = ask + [patch.model_dump(exclude_none=True),
                  {"type": "custom_tool_call_output", "call_id": patch.call_id, "output": "applied"}]
    again = client.responses.create(model="SmolLM2-135M-Instruct", input=sent, tools=TOOLS + [NAMESPACE, PATCH],
                                    max_output_tokens=4, temperature=0)
    chat = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": patch.call_id, "type": "function", "function": {"name": "apply_patch",
                                                               "arguments": {"input": patch.input}}}]},
                  {"role": "tool", "tool_call_id": patch.call_id, "content": "applied"}]
    assert again.usage.input_tokens == prompt_tokens(server, chat, tools=OFFERED)
    logged = [line for line in server.log.read_text().splitlines() if "built-in tools" in line]
    assert len(logged) == 1 and all(t["type"] in logged[0] for t in HOSTED)  # once, naming each type


def test_reasoning_items_and_effort_reach_the_template(client, server):
    """A reasoning item sent back renders as the next assistant turn's thinking; effort 'none' turns the
    template's thinking off (Qwen3's template then writes an empty <think> block)."""
    items = [{"role": "user", "content": "hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "The user greets me."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Again?"}]}]
    reply = client.responses.create(model="SmolLM2-135M-Instruct", input=items, max_output_tokens=4,
                                    temperature=0)
    chat = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets me."},
            {"role": "user", "content": "Again?"}]
    assert reply.usage.input_tokens == prompt_tokens(server, chat)
    off = client.responses.create(model="SmolLM2-135M-Instruct", input="hi", reasoning={"effort": "none"},
                                  max_output_tokens=4, temperature=0)
    assert off.usage.input_tokens == prompt_tokens(server, [{"role": "user", "content": "hi"}],
                                                   chat_template_kwargs={"enable_thinking": False})
    assert off.usage.input_tokens > prompt_tokens(server, [{"role": "user", "content": "hi"}])
    assert off.reasoning.effort == "none"


def test_text_format_json_schema(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["colour", "count"], "properties": {
        "colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9}}}
    reply = client.responses.create(model="SmolLM2-135M-Instruct", input="Pick a colour and a count.",
                                    max_output_tokens=40, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "pick", "strict": True,
                                                     "schema": schema}})
    jsonschema.validate(json.loads(reply.output_text), schema)
    assert reply.text.format.type == "json_schema"


def test_refusals_name_the_field(server, client):
    base = {"input": "hi", "max_output_tokens": 4}
    cases = [({"tools": [{"type": "web_serach"}]}, "tools[0].type", "'web_serach' is not a tool type"),
             ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice",
              "'web_search' is a built-in tool"),
             ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice", "web_search"),
             ({"tools": [TOOLS[0], {"type": "namespace", "name": "ns", "description": "d", "tools": []}]},
              "tools[1].tools", "'ns' has no tools"),
             ({"tools": [{"type": "function", "name": "ns.run"}, NAMESPACE]}, "tools[1].tools[1].name",
              "'ns.run' is also the name of tools[0]"),
             ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
              "tools[0].tools[0].type", "function or custom"),
             ({"tools": [{"type": "custom", "name": "patch", "format": {"type": "yaml"}}]}, "tools[0].format",
              "grammar"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name",
              "read_file, run"),
             ({"tool_choice": "required"}, "tool_choice", "tools"),
             ({"text": {"format": {"type": "yaml"}}}, "text.format", "json_schema"),
             ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type", "computer_call_output"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
              "input[0].content[0]", "file_id"),
             ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
              "input[0].content[0]", "input_file"),
             ({"previous_response_id": "resp_unknown"}, "previous_response_id", "evicted"),
             ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1")]
    for extra, param, fragment in cases:
        error = assert_openai_error(server.post("/v1/responses", json={**base, **extra}), 400, fragment)
        assert error["param"] == param, (extra, error)
    assert_openai_error(server.get("/v1/responses/resp_unknown"), 404, "resp_unknown")
    assert_openai_error(httpx.delete(server.url + "/v1/responses/resp_unknown", trust_env=False), 404,
                        "resp_unknown")
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model="SmolLM2-135M-Instruct", input="hi", tools=[{"type": "web_search"}],
                                tool_choice={"type": "web_search"})
    assert server.get("/health").status_code == 200


def test_store_keeps_the_newest_within_its_bytes():
    store = ResponseStore(4000)
    bodies = [{"id": f"resp_{i}", "output": [{"type": "message", "text": "x" * 900}]} for i in range(6)]
    for body in bodies:
        assert store.put(body, [{"role": "user", "content": "hi"}])
    assert store.used_bytes <= 4000 and store.evicted == 6 - len(store)
    assert store.get("resp_5").body == bodies[5] and store.get("resp_0") is None
    assert "evicted" in store.missing("resp_0", "previous_response_id")
    assert not store.put({"id": "resp_big", "output": "y" * 5000}, [])  # larger than the whole store: not kept
    assert not ResponseStore(0).put(bodies[0], []) and "--responses-store-bytes 0" in ResponseStore(0).missing(
        "resp_0", "previous_response_id")
