"""Serving coding agents, end to end: a real server (built-in SmolLM2, run with Qwen3's own chat template via
--chat-template: ChatML like SmolLM2's, with hermes tool calls and <think> blocks) driven by the official
`openai` package. The small model is too weak to call tools of its own accord, so the calls here are forced
(tool_choice required / named, enforced by the grammar); the parsers of free calls are proven on the families'
template texts in test_text_parsers.py. Arguments are checked with `jsonschema`, never against fixed strings.
"""

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from server_util import SMALL_POOL, assert_openai_error, running_server

TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "qwen3.jinja"
READ_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["path", "line"], "properties": {
    "path": {"type": "string", "maxLength": 24}, "line": {"type": "integer", "minimum": 1, "maximum": 999}}}
RUN_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["command"], "properties": {
    "command": {"type": "string", "maxLength": 30}}}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a line of a file",
                                           "parameters": READ_SCHEMA}},
         {"type": "function", "function": {"name": "run", "description": "Run a shell command",
                                           "parameters": RUN_SCHEMA}}]
SCHEMAS = {"read_file": READ_SCHEMA, "run": RUN_SCHEMA}
ASK = [{"role": "system", "content": "You are a coding agent."},
       {"role": "user", "content": "Show me line 3 of setup.py."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("agents"), *SMALL_POOL, "--chat-template", str(TEMPLATE)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_returns_a_valid_call(client):
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=ASK, tools=TOOLS, max_tokens=120,
        temperature=0, tool_choice={"type": "function", "function": {"name": "read_file"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls, {"read_file"})


def test_required_tool_choice_streams_through_the_openai_helper(client):
    model = client.models.list().data[0].id
    with client.chat.completions.stream(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                        max_tokens=160, temperature=0.7, seed=3,
                                        parallel_tool_calls=False) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, set(SCHEMAS))
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false: the grammar allows one call
    assert "tool_calls.function.arguments.done" in events


def test_named_call_streamed_equals_non_streamed(client):
    model = client.models.list().data[0].id
    body = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                tool_choice={"type": "function", "function": {"name": "run"}})
    whole = client.chat.completions.create(**body).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**body, stream=True))
    pieces = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert pieces[0].id and pieces[0].function.name == "run"  # id and name first, then the arguments
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    assert "".join(p.function.arguments or "" for p in pieces) == whole.function.arguments
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]


def test_response_format_json_schema_strict(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["colour", "count"], "properties": {
        "colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9}}}
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Pick a colour and a count."}],
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "strict": True, "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=40, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Reply in JSON."}])
    assert reply.choices[0].finish_reason in ("stop", "length")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_multi_turn_agent_exchange_renders_prior_calls(client, server):
    """call -> tool result -> next call -> answer; prior calls and results are rendered as the template writes."""
    model = client.models.list().data[0].id
    messages = list(ASK)
    for name in ("read_file", "run"):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=120,
                                               temperature=0, tool_choice={"type": "function",
                                                                           "function": {"name": name}})
        message = reply.choices[0].message
        check_calls(message.tool_calls, {name})
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "x = 3"})
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=20, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls
    rendered = server.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    prompt = server.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    for message in messages[2::2]:  # each prior call as the template writes it: JSON inside <tool_call> tags
        call = message["tool_calls"][0]["function"]
        arguments = json.dumps(json.loads(call["arguments"]), ensure_ascii=False)
        assert f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {arguments}}}\n</tool_call>' in prompt
    assert prompt.count("<tool_response>\nx = 3\n</tool_response>") == 2
    assert rendered["count"] == len(rendered["tokens"]) and rendered["max_model_len"] > rendered["count"]


def test_thinking_is_split_and_can_be_switched_off(client, server):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "hi"}]
    off = server.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    prompt = server.post("/detokenize", json={"tokens": off.json()["tokens"]}).json()["prompt"]
    assert prompt.endswith("<think>\n\n</think>\n\n")
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].message.content is not None


def test_bad_tool_requests_get_clear_errors(server):
    base = {"messages": ASK, "tools": TOOLS, "max_tokens": 5}
    answer = server.post("/v1/chat/completions", json={**base, "tool_choice": {
        "type": "function", "function": {"name": "delete_everything"}}})
    assert_openai_error(answer, 400, "delete_everything", "read_file, run")
    answer = server.post("/v1/chat/completions", json={"messages": ASK, "tool_choice": "required"})
    assert_openai_error(answer, 400, "tool_choice", "tools")
    answer = server.post("/v1/chat/completions", json={**base, "response_format": {"type": "yaml"}})
    assert_openai_error(answer, 400, "response_format", "json_schema")
    answer = server.post("/v1/chat/completions", json={**base, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "(("}}}}}})
    assert_openai_error(answer, 400)
    assert server.get("/health").status_code == 200
    models = server.get("/v1/models").json()["data"]
    assert models[0]["max_model_len"] > 0


# -- Anthropic Messages API, with the official `anthropic` package ---------------------------------------------

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
GREEDY = {"temperature": 0}  # this SDK version leaves sampling settings to extra_body


@pytest.fixture(scope="module")
def claude(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def test_anthropic_text_and_count_tokens(claude):
    messages = [{"role": "user", "content": "Name a colour."}]
    reply = claude.messages.create(model="SmolLM2-135M-Instruct", max_tokens=12, messages=messages,
                                   system="Be brief.", extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant"
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens")
    count = claude.messages.count_tokens(model="SmolLM2-135M-Instruct", messages=messages, system="Be brief.")
    # the prompt is read (input_tokens) or taken from the prefix cache (cache_read_input_tokens)
    assert count.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 0
    # A stop sequence taken from the answer itself ends the next (identical, greedy) answer there.
    words = [w for w in reply.content[0].text.split() if len(w) > 2]
    if words and reply.stop_reason == "max_tokens":
        again = claude.messages.create(model="SmolLM2-135M-Instruct", max_tokens=12, messages=messages,
                                       system="Be brief.", stop_sequences=[words[-1]], extra_body=GREEDY)
        assert again.stop_reason == "stop_sequence" and again.stop_sequence == words[-1]
        assert words[-1] not in again.content[0].text


def test_anthropic_forced_tool_use(claude):
    reply = claude.messages.create(model="SmolLM2-135M-Instruct", max_tokens=120, messages=ASK[1:],
                                   tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "read_file"},
                                   extra_body=GREEDY)
    assert reply.stop_reason == "tool_use"
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "read_file" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, READ_SCHEMA)


def sum_input(usage) -> int:
    """The prompt's tokens: those read and those the prefix cache supplied."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_anthropic_stream_events_and_multi_turn(claude):
    """any-tool call streamed with the SDK helper, its result sent back, a named call, then a plain answer."""
    messages = list(ASK[1:])
    with claude.messages.stream(model="SmolLM2-135M-Instruct", max_tokens=160, messages=messages,
                                tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") >= 1
    assert final.stop_reason == "tool_use"
    uses = [b for b in final.content if b.type == "tool_use"]
    for use in uses:
        jsonschema.validate(use.input, SCHEMAS[use.name])
    messages += [{"role": "assistant", "content": [b.model_dump() for b in final.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "x = 3"}
                                              for u in uses]}]
    second = claude.messages.create(model="SmolLM2-135M-Instruct", max_tokens=120, messages=messages,
                                    tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "run"},
                                    extra_body=GREEDY)
    assert second.stop_reason == "tool_use"
    assert sum_input(second.usage) > sum_input(final.usage) and second.usage.cache_read_input_tokens > 0
    messages += [{"role": "assistant", "content": [b.model_dump() for b in second.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": second.content[-1].id,
                                               "content": "done"}, {"type": "text", "text": "Summarise."}]}]
    answer = claude.messages.create(model="SmolLM2-135M-Instruct", max_tokens=10, messages=messages,
                                    tools=ANTHROPIC_TOOLS, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_anthropic_errors_in_its_shape(server, claude):
    import anthropic

    answer = server.post("/v1/messages", json={"messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 400
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="nope"):
        claude.messages.create(model="SmolLM2-135M-Instruct", max_tokens=5, messages=ASK[1:], tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=5, messages=ASK[1:])
    assert server.get("/health").status_code == 200


# -- opencode (npm opencode-ai) as the client ---------------------------------------------------------------

def opencode_binary() -> str | None:
    """OPENCODE_BIN, or `opencode` on PATH (npm install -g opencode-ai); None skips the test."""
    import os
    import shutil

    return os.environ.get("OPENCODE_BIN") or shutil.which("opencode")


@pytest.mark.skipif(opencode_binary() is None, reason="opencode not installed (npm install -g opencode-ai), "
                                                      "or set OPENCODE_BIN")
def test_opencode_runs_a_task_against_the_server(server, tmp_path):
    """opencode, with deltaserve as its OpenAI-compatible provider, runs one task non-interactively: its
    requests are accepted (no error counted by the server) and its streams parse (opencode reports the step's
    token usage). The exchange (opencode's JSON events) is printed."""
    import subprocess

    model = server.get("/v1/models").json()["data"][0]["id"]
    project = tmp_path / "project"
    project.mkdir()
    (project / "hello.py").write_text('print("hello")\n')
    config = {"$schema": "https://opencode.ai/config.json", "model": f"deltaserve/{model}",
              "small_model": f"deltaserve/{model}", "share": "disabled", "autoupdate": False,
              "provider": {"deltaserve": {"npm": "@ai-sdk/openai-compatible", "name": "deltaserve",
                                          "options": {"baseURL": server.url + "/v1", "apiKey": "unused"},
                                          "models": {model: {"name": model,
                                                             "limit": {"context": 8192, "output": 24}}}}},
              # The small model's context is 8K: opencode's own system prompt and tool list would fill it.
              "agent": {"build": {"prompt": "You are a coding agent. Answer briefly.",
                                  "tools": {"*": False, "read": True}}}}
    (project / "opencode.json").write_text(json.dumps(config))
    chats_before = server.metric("deltaserve_http_requests_total", '{endpoint="chat"}')
    errors_before = error_count(server)
    done = subprocess.run([opencode_binary(), "run", "--format", "json", "--pure", "What does hello.py print?"],
                          cwd=project, env={"HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=600)
    print("opencode stdout (its JSON events):\n" + done.stdout + "\nopencode stderr:\n" + done.stderr[-3000:])
    assert done.returncode == 0
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert not [e for e in events if e["type"] == "error"]
    finishes = [e["part"] for e in events if e["type"] == "step_finish"]
    assert finishes and finishes[-1]["tokens"]["input"] > 0 and finishes[-1]["tokens"]["output"] > 0
    assert server.metric("deltaserve_http_requests_total", '{endpoint="chat"}') > chats_before
    assert error_count(server) == errors_before, "the server refused or failed one of opencode's requests"


def error_count(server) -> float:
    """All error responses the server has counted, whatever their status."""
    lines = server.get("/metrics").text.splitlines()
    return sum(float(line.split(" ")[1]) for line in lines if line.startswith("deltaserve_http_errors_total{"))
