"""Serving coding agents, end to end: a real server (built-in SmolLM2, run with Qwen3's own chat template via
--chat-template: ChatML like SmolLM2's, with hermes tool calls and <think> blocks) driven by the official
`openai` package. The small model is too weak to call tools of its own accord, so the calls here are forced
(tool_choice required / named, enforced by the grammar); the parsers of free calls are proven on the families'
template texts in test_text_parsers.py. Arguments are checked with `jsonschema`, never against fixed strings.

One file over 500 lines on purpose: opencode and Claude Code share one module-scoped server, and all the agents the
recording proxy (tests/agent_proxy.py); Codex CLI, whose default prompt is longer than the model's 8K context, has a
server of its own.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import pytest

from agent_proxy import RecordingProxy, sse_chunks, sse_events
from server_util import SMALL_POOL, assert_openai_error, hf_tokenizer, running_server

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


@pytest.fixture(scope="module")
def oracle():
    """The conversation as transformers renders it with the same template file, as text and as token ids of the
    built-in model's own Hugging Face tokenizer: what the server must render, found independently."""
    hf_tok, template = hf_tokenizer(), TEMPLATE.read_text()

    def render(messages: list[dict], tokenize: bool = False):
        out = hf_tok.apply_chat_template(messages, tools=TOOLS, chat_template=template, add_generation_prompt=True,
                                         tokenize=tokenize)
        return out if not tokenize or isinstance(out, list) else list(out["input_ids"])
    return render


def as_template_call(call: dict) -> dict:
    """A prior call as transformers' chat templates take it: arguments as an object, not a JSON string."""
    function = call["function"]
    return {"id": call["id"], "type": "function",
            "function": {"name": function["name"], "arguments": json.loads(function["arguments"])}}


THOUGHTS = ["The user wants line 3, so read the file first.", "Line 3 assigns x; run it to see what it does."]


def test_multi_turn_agent_exchange_renders_prior_calls_and_reasoning(client, server, oracle):
    """call -> tool result -> next call -> tool result -> answer -> next question, through the openai package; each
    assistant turn goes back with the reasoning a thinking model would have returned beside its call. The prompt
    the server renders (/tokenize, /detokenize) equals transformers' rendering of the same conversation: prior calls
    as the template writes them, reasoning kept for the turns after the last user query, dropped once a new query
    comes."""
    model = client.models.list().data[0].id
    messages, expected = list(ASK), list(ASK)  # what the client sends; what the oracle renders
    for name, thought in zip(("read_file", "run"), THOUGHTS):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=120,
                                               temperature=0, tool_choice={"type": "function",
                                                                           "function": {"name": name}})
        message = reply.choices[0].message
        check_calls(message.tool_calls, {name})
        sent = {**message.model_dump(exclude_none=True), "reasoning_content": thought}
        result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": f"x = {len(messages)}"}
        messages += [sent, result]
        expected += [{"role": "assistant", "content": message.content or "", "reasoning_content": thought,
                      "tool_calls": [as_template_call(c) for c in sent["tool_calls"]]}, result]
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=20, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls
    messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
    expected.append(messages[-1])

    def rendered(conversation: list[dict]) -> tuple[dict, str]:
        tokens = server.post("/tokenize", json={"messages": conversation, "tools": TOOLS}).json()
        return tokens, server.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]

    tokens, prompt = rendered(messages)
    assert prompt == oracle(expected)
    assert tokens["tokens"] == oracle(expected, tokenize=True)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > tokens["count"]
    for message in expected[2::2][:2]:  # each prior call as the template writes it: JSON inside <tool_call> tags
        call = message["tool_calls"][0]["function"]
        arguments = json.dumps(call["arguments"], ensure_ascii=False)
        assert f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {arguments}}}\n</tool_call>' in prompt
    assert all(f"<think>\n{thought}\n</think>" in prompt for thought in THOUGHTS)
    follow = {"role": "user", "content": "Thanks. And line 4?"}
    _, prompt = rendered(messages + [follow])
    assert prompt == oracle(expected + [follow])
    assert not any(thought in prompt for thought in THOUGHTS)  # a new query: earlier turns drop their reasoning


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


def sum_input(usage) -> int:
    """The prompt's tokens: those read and those the prefix cache supplied."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_anthropic_text_and_count_tokens(claude):
    messages = [{"role": "user", "content": "Name a colour."}]
    reply = claude.messages.create(model="SmolLM2-135M-Instruct", max_tokens=12, messages=messages,
                                   system="Be brief.", extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant"
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens")
    count = claude.messages.count_tokens(model="SmolLM2-135M-Instruct", messages=messages, system="Be brief.")
    # the prompt is read (input_tokens) or taken from the prefix cache (cache_read_input_tokens)
    assert count.input_tokens == sum_input(reply.usage) > 0
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


def test_anthropic_stream_events_and_multi_turn(claude, oracle):
    """any-tool call streamed with the SDK helper, its result sent back, a named call, then a plain answer; each
    assistant turn goes back with a thinking block. The server's prompt is the one transformers renders from the
    same conversation in OpenAI terms (thinking as reasoning_content, tool_use as tool_calls, tool_result as tool
    messages): equal token counts from count_tokens and from the answer's usage, and thinking counts only for the
    turns after the last user query."""
    model = "SmolLM2-135M-Instruct"
    messages, expected = list(ASK[1:]), list(ASK[1:])
    with claude.messages.stream(model=model, max_tokens=160, messages=messages, tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") >= 1
    assert final.stop_reason == "tool_use"
    uses = [b for b in final.content if b.type == "tool_use"]
    for use in uses:
        jsonschema.validate(use.input, SCHEMAS[use.name])

    def send_back(reply, thought: str) -> None:
        """The reply as the next request's assistant turn, with a thinking block, and a result for each call."""
        blocks = [b.model_dump() for b in reply.content]
        uses = [b for b in blocks if b["type"] == "tool_use"]
        messages.extend([{"role": "assistant", "content": [{"type": "thinking", "thinking": thought,
                                                             "signature": ""}] + blocks},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u["id"],
                                                       "content": "x = 3"} for u in uses]}])
        expected.append({"role": "assistant", "reasoning_content": thought,
                         "content": "".join(b["text"] for b in blocks if b["type"] == "text"),
                         "tool_calls": [{"id": u["id"], "type": "function",
                                         "function": {"name": u["name"], "arguments": u["input"]}} for u in uses]})
        expected.extend({"role": "tool", "tool_call_id": u["id"], "content": "x = 3"} for u in uses)

    send_back(final, THOUGHTS[0])
    second = claude.messages.create(model=model, max_tokens=120, messages=messages, tools=ANTHROPIC_TOOLS,
                                    tool_choice={"type": "tool", "name": "run"}, extra_body=GREEDY)
    assert second.stop_reason == "tool_use"
    assert sum_input(second.usage) > sum_input(final.usage) and second.usage.cache_read_input_tokens > 0
    send_back(second, THOUGHTS[1])
    answer = claude.messages.create(model=model, max_tokens=10, messages=messages, tools=ANTHROPIC_TOOLS,
                                    extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    expected_ids = oracle(expected, tokenize=True)
    assert sum_input(answer.usage) == len(expected_ids)
    count = claude.messages.count_tokens(model=model, messages=messages, tools=ANTHROPIC_TOOLS).input_tokens
    assert count == len(expected_ids)
    unthought = [{**m, "content": [b for b in m["content"] if b["type"] != "thinking"]}
                 if m["role"] == "assistant" else m for m in messages]
    assert claude.messages.count_tokens(model=model, messages=unthought, tools=ANTHROPIC_TOOLS).input_tokens < count
    follow = {"role": "user", "content": "Thanks. Summarise."}
    count = claude.messages.count_tokens(model=model, messages=messages + [follow], tools=ANTHROPIC_TOOLS)
    assert count.input_tokens == len(oracle(expected + [follow], tokenize=True))
    assert count.input_tokens == claude.messages.count_tokens(  # a new query: earlier thinking is dropped
        model=model, messages=unthought + [follow], tools=ANTHROPIC_TOOLS).input_tokens


CODER = "You are a coding agent. " + " ".join(f"Rule {i}: read before you write, and say what you changed."
                                             for i in range(1, 25))


def claude_code_system(version: str, entrypoint: str) -> list[dict]:
    """A system prompt as Claude Code sends it: its billing-header stamp first, then its text with cache_control."""
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version={version}; cc_entrypoint={entrypoint};"},
            {"type": "text", "text": CODER, "cache_control": {"type": "ephemeral"}}]


def test_anthropic_takes_claude_codes_requests(claude, server):
    """What Claude Code sends beside plain Messages: a system message after the first user turn (rendered in place by
    this template, which renders later system messages), adaptive thinking with an effort, context_management,
    metadata and cache_control (read, not acted on), and a billing-header line first in the system prompt that
    changes from version to version and entry point to entry point. The line is not part of the prompt, so the
    second turn, stamped differently, finds the first turn's prompt in the prefix cache."""
    model = "SmolLM2-135M-Instruct"
    env = {"role": "system", "content": [{"type": "text", "text": "# Environment\nWorking directory: /tmp/project",
                                          "cache_control": {"type": "ephemeral"}}]}
    messages = [{"role": "user", "content": "Show me line 3 of setup.py."}, env]
    extra = {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
             "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
             "metadata": {"user_id": "someone"}}
    first = claude.messages.create(model=model, max_tokens=8, messages=messages,
                                   system=claude_code_system("2.1.332.862", "sdk-cli"), extra_body={**GREEDY, **extra})
    assert first.stop_reason in ("end_turn", "max_tokens")
    as_chat = [{"role": "system", "content": CODER}, messages[0],
               {"role": "system", "content": "# Environment\nWorking directory: /tmp/project"}]
    rendered = server.post("/tokenize", json={"messages": as_chat}).json()["count"]
    assert sum_input(first.usage) == rendered  # the stamp is not in the prompt, the later system message is

    def count(**changes) -> int:
        body = {"model": model, "messages": messages, "system": claude_code_system("2.1.332.862", "sdk-cli"),
                **extra, **changes}
        return claude.messages.count_tokens(**{k: body.pop(k) for k in ("model", "messages", "system")},
                                            extra_body=body).input_tokens

    assert count() == count(system=claude_code_system("2.1.340.1", "cli")) == count(system=CODER) == rendered
    off = count(thinking={"type": "disabled"})
    assert off > rendered and count(output_config={"effort": "low"}) == off  # adaptive at low effort: no thinking

    messages += [{"role": "assistant", "content": [{"type": "text", "text": first.content[0].text}]},
                 {"role": "user", "content": "Thanks. And line 4?"}]
    second = claude.messages.create(model=model, max_tokens=8, messages=messages,
                                    system=claude_code_system("2.1.333.117", "cli"), extra_body={**GREEDY, **extra})
    assert second.usage.cache_read_input_tokens >= 0.8 * sum_input(first.usage), (first.usage, second.usage)


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


# -- curl, with the body in a file as users send large ones -------------------------------------------------

def curl_stream(server, path: str, body: dict, tmp_path: Path) -> str:
    """What `curl -N -d @body.json` prints for a POST of `body` (it fails the test on an HTTP error)."""
    file = tmp_path / "body.json"
    file.write_text(json.dumps(body))
    done = subprocess.run(["curl", "-sS", "-N", "--fail-with-body", "-H", "Content-Type: application/json",
                           "-d", f"@{file}", server.url + path], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_forced_calls_on_both_apis(server, tmp_path):
    """A named call streamed to curl by each API: OpenAI chunks whose argument fragments join into valid arguments
    and finish with tool_calls; Anthropic's event sequence whose input_json_delta pieces do the same."""
    chunks = sse_chunks(curl_stream(server, "/v1/chat/completions", {
        "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "run"}},
        "stream": True, "max_tokens": 80, "temperature": 0}, tmp_path).encode())
    pieces = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls") or []]
    assert pieces[0]["function"]["name"] == "run" and pieces[0]["id"].startswith("call_")
    jsonschema.validate(json.loads("".join(p["function"].get("arguments") or "" for p in pieces)), RUN_SCHEMA)
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["tool_calls"]

    text = curl_stream(server, "/v1/messages", {
        "model": "SmolLM2-135M-Instruct", "max_tokens": 80, "messages": ASK[1:], "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "tool", "name": "read_file"}, "stream": True, "temperature": 0}, tmp_path)
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        events.append((name[len("event: "):], json.loads(data[len("data: "):])))
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert [b["type"] for b in starts] == ["tool_use"] and starts[0]["name"] == "read_file"
    partial = "".join(data["delta"]["partial_json"] for name, data in events if name == "content_block_delta")
    jsonschema.validate(json.loads(partial), READ_SCHEMA)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


# -- opencode (npm opencode-ai) as the client ---------------------------------------------------------------

def opencode_binary() -> str | None:
    """OPENCODE_BIN, else the opencode `make install` puts beside the venv (npm's opencode-ai under <venv>/node),
    else `opencode` on PATH; None skips the test."""
    local = Path(sys.prefix) / "node" / "node_modules" / ".bin" / "opencode"
    return os.environ.get("OPENCODE_BIN") or (str(local) if local.exists() else None) or shutil.which("opencode")


# opencode, offline: no update check, no models.dev catalogue, no sharing, no LSP or plugin downloads, no Claude
# Code files from the home folder; its config, data and cache live in the test's own folder.
OPENCODE_OFFLINE = {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                    "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1",
                    "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1"}


UNDER_CI = os.environ.get("CI", "").lower() in ("true", "1")


def agent_or_fail(binary: str | None, missing: str) -> str:
    """The agent's binary; a missing one skips its test, and fails it under CI (CI=true), where a green run must
    mean that every agent ran."""
    if binary is None:
        if UNDER_CI:
            pytest.fail(f"{missing} (CI is set: a missing agent fails the run)")
        pytest.skip(missing)
    return binary


def force_opencode(target: str):
    """As force_codex, for opencode's read tool on chat completions: a forced read of `target` until a tool result
    comes back, then the answer."""
    def rewrite(path: str, body: dict) -> dict:
        if path.split("?")[0] != "/v1/chat/completions":
            return body
        for tool in body.get("tools", []):
            if tool["function"]["name"] == "read":
                tool["function"]["parameters"] = one_value("filePath", target)
        body.pop("max_completion_tokens", None)
        if not any(m.get("role") == "tool" for m in body["messages"]):
            return {**body, "tool_choice": {"type": "function", "function": {"name": "read"}}, "max_tokens": 120}
        return {**body, "tool_choice": "none", "max_tokens": 24, "response_format": {
            "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}}
    return rewrite


def text_of(content) -> str:
    """A tool result's text: a string, or the text of its parts."""
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)


def test_opencode_runs_a_task_against_the_server(server, tmp_path):
    """opencode, with deltaserve as its OpenAI-compatible provider, runs one task non-interactively (`opencode
    run`) through a recording proxy that forces a read of hello.py, then the answer: opencode runs the tool and
    sends its result back as a tool message answering the call; every request it sends is accepted (200, no error
    counted by the server), every stream it gets parses as OpenAI chunks ending in [DONE], opencode reports the
    step's token usage (it parsed the stream too), and the whole exchange is printed."""
    binary = agent_or_fail(opencode_binary(), "opencode is not installed: `make test` puts npm's opencode-ai under "
                           ".venv/node when npm is on PATH (or set OPENCODE_BIN)")
    model = server.get("/v1/models").json()["data"][0]["id"]
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    (project / "hello.py").write_text('print("hello")\n')
    target = str(project / "hello.py")
    errors_before = error_count(server)
    with RecordingProxy(server.url, force_opencode(target)) as proxy:
        config = {"$schema": "https://opencode.ai/config.json", "model": f"deltaserve/{model}",
                  "small_model": f"deltaserve/{model}", "share": "disabled", "autoupdate": False,
                  "provider": {"deltaserve": {"npm": "@ai-sdk/openai-compatible", "name": "deltaserve",
                                              "options": {"baseURL": proxy.url + "/v1", "apiKey": "unused"},
                                              "models": {model: {"name": model,
                                                                 "limit": {"context": 8192, "output": 24}}}}},
                  # The small model's context is 8K: opencode's own system prompt and tool list would fill it.
                  "agent": {"build": {"prompt": "You are a coding agent. Answer briefly.",
                                      "tools": {"*": False, "read": True}}}}
        (project / "opencode.json").write_text(json.dumps(config))
        env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "XDG_CONFIG_HOME": str(home / ".config"),
               "XDG_DATA_HOME": str(home / ".local/share"), "XDG_CACHE_HOME": str(home / ".cache"),
               "XDG_STATE_HOME": str(home / ".local/state"), **OPENCODE_OFFLINE}
        # --title: no extra request for a session title; --pure: no external plugins.
        done = subprocess.run([binary, "run", "--format", "json", "--pure", "--title", "hello",
                               "What does hello.py print?"], cwd=project, env=env, capture_output=True, text=True,
                              timeout=600)
    print("the exchange, as the proxy relayed it:\n" + proxy.log())
    print("opencode stdout (its JSON events):\n" + done.stdout + "\nopencode stderr:\n" + done.stderr[-3000:])
    assert done.returncode == 0
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert not [e for e in events if e["type"] == "error"]
    finishes = [e["part"] for e in events if e["type"] == "step_finish"]
    assert finishes and finishes[-1]["tokens"]["input"] > 0 and finishes[-1]["tokens"]["output"] > 0
    chats = [x for x in proxy.exchanges if x["path"] == "/v1/chat/completions"]
    assert len(chats) == 2 and all(x["status"] == 200 for x in proxy.exchanges), proxy.log()
    runs = [e["part"] for e in events if e["type"] == "tool_use"]
    assert [(r["tool"], r["state"]["status"], r["state"]["input"]) for r in runs] == [
        ("read", "completed", {"filePath": target})]
    assert 'print("hello")' in runs[0]["state"]["output"]
    [call] = [tc for c in sse_chunks(chats[0]["response"]) for ch in c["choices"] for tc in ch["delta"].get(
        "tool_calls") or [] if tc.get("id")]
    results = [m for m in json.loads(chats[1]["original"])["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == [call["id"]]  # the tool's result went back, answering the call
    assert 'print("hello")' in text_of(results[0]["content"])
    for x in chats:
        assert json.loads(x["request"])["model"] == model
        chunks = sse_chunks(x["response"])
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] in (
            ["stop"], ["length"], ["tool_calls"])
    text = "".join(e["part"]["text"] for e in events if e["type"] == "text")
    streamed = "".join(ch["delta"].get("content") or "" for x in chats for c in sse_chunks(x["response"])
                       for ch in c["choices"])
    assert text.strip() and text.strip() in streamed  # what opencode shows is what the server streamed
    assert error_count(server) == errors_before, "the server refused or failed one of opencode's requests"


def error_count(server) -> float:
    """All error responses the server has counted, whatever their status."""
    lines = server.get("/metrics").text.splitlines()
    return sum(float(line.split(" ")[1]) for line in lines if line.startswith("deltaserve_http_errors_total{"))


# -- Codex CLI (npm @openai/codex, Responses API) and Claude Code (npm @anthropic-ai/claude-code, Messages API) ----

def agent_binary(variable: str, package_dir: str, name: str) -> str | None:
    """`variable` from the environment, else the agent `make test` puts beside the venv (npm's package under
    <venv>/node/<package_dir>), else `name` on PATH; None skips its test."""
    local = Path(sys.prefix) / "node" / package_dir / "node_modules" / ".bin" / name
    return os.environ.get(variable) or (str(local) if local.exists() else None) or shutil.which(name)


CODEX = agent_binary("CODEX_BIN", "codex", "codex")
CLAUDE = agent_binary("CLAUDE_BIN", "claude-code", "claude")
QWEN = agent_binary("QWEN_BIN", "qwen-code", "qwen")
AGENT_PROMPT = "You are a coding agent. Answer briefly."


def one_value(field: str, value: str) -> dict:
    """A tool's parameters narrowed to one argument value: the forced call's grammar writes exactly it, so the
    agent runs nothing else."""
    return {"type": "object", "additionalProperties": False, "required": [field],
            "properties": {field: {"enum": [value]}}}


ANSWER = {"type": "string", "enum": ["It prints hello."]}  # the forced answer: one that ends (a cut one fails a turn)


NAMESPACE_CALL = ("multi_agent_v1", "close_agent")  # a sub-agent tool of Codex's default namespace: one that starts
# no second agent session (spawn_agent would, with its own long prompt), answered by Codex all the same


def force_codex(path: str, body: dict) -> dict:
    """The model is too small to call a tool of its own accord: the proxy forces exec_command (tool_choice) until a
    call's output comes back, then the namespace's close_agent, then the answer (tool_choice none and a JSON schema
    of one string). The tools' schemas are narrowed on every turn alike, so the prompt's prefix stays the same from
    turn to turn; the tool list is otherwise Codex's own."""
    if path.split("?")[0] != "/v1/responses":
        return body
    for tool in body.get("tools", []):
        if tool.get("name") == "exec_command":
            tool["parameters"] = one_value("cmd", "cat hello.py")
        for member in tool.get("tools", []) if tool.get("name") == NAMESPACE_CALL[0] else []:
            if member.get("name") == NAMESPACE_CALL[1]:
                member["parameters"] = one_value("target", "agent-1")
    answered = sum(isinstance(item, dict) and item.get("type") == "function_call_output" for item in body["input"])
    if answered == 0:
        return {**body, "tool_choice": {"type": "function", "name": "exec_command"}, "max_output_tokens": 24}
    if answered == 1:
        namespace, name = NAMESPACE_CALL
        return {**body, "tool_choice": {"type": "function", "name": name, "namespace": namespace},
                "max_output_tokens": 24}
    return {**body, "tool_choice": "none", "max_output_tokens": 24,
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}}


def force_claude(target: str):
    """As force_codex, for Claude Code's Read tool."""
    def rewrite(path: str, body: dict) -> dict:
        if path.split("?")[0] != "/v1/messages":
            return body
        for tool in body.get("tools", []):
            if tool.get("name") == "Read":
                tool["input_schema"] = one_value("file_path", target)
        last = body["messages"][-1]["content"]
        if not (isinstance(last, list) and any(block.get("type") == "tool_result" for block in last)):
            return {**body, "tool_choice": {"type": "tool", "name": "Read"}, "max_tokens": 120}  # a long path
        return {**body, "tool_choice": {"type": "none"}, "max_tokens": 24,
                "output_config": {**body.get("output_config", {}), "format": {"type": "json_schema",
                                                                               "schema": ANSWER}}}
    return rewrite


def agent_project(tmp_path: Path) -> tuple[Path, Path]:
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    home.mkdir()
    (project / "hello.py").write_text('print("hello")\n')
    return project, home


def streamed_events(exchange: dict, adapter) -> list:
    """A streamed answer's events as the SDK's own types parse them (Anthropic's SDK skips `ping`)."""
    assert exchange["status"] == 200, exchange["response"][:500]
    return [adapter.validate_python(data) for _, data in sse_events(exchange["response"]) if data["type"] != "ping"]


# Codex as a user sets it up: its provider, nothing else (its default tools, instructions and sandbox); no retries.
CODEX_CONFIG = """
model = "{model}"
model_provider = "deltaserve"

[model_providers.deltaserve]
name = "deltaserve"
base_url = "{url}/v1"
env_key = "DELTASERVE_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
"""
# Codex's default prompt (its instructions and tool list) is ~9K tokens of this model's tokenizer: more than the
# built-in model's 8K context, so its server reads a longer one (RoPE past its training: the calls are forced).
CODEX_CONTEXT = ("--max-total-tokens", "16384", "--context-length", "16384", "--max-running-requests", "2")


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("long"), *CODEX_CONTEXT, "--chat-template", str(TEMPLATE)) as s:
        yield s


def test_codex_runs_a_tool_call_session(long_server, tmp_path):
    """`codex exec` in its default configuration (a provider block only) with deltaserve as its Responses API
    provider, through the recording proxy: every request carries Codex's default tool list (functions, the
    multi_agent_v1 namespace, the built-in web_search, which the server leaves out and names in its header). A forced
    exec_command call, which Codex runs (`cat hello.py`) and sends back as a function_call_output; a forced call of
    the namespace's close_agent, which comes back as a function_call item carrying the namespace and which Codex
    answers; then the answer. Every event streamed parses as the openai package's own ResponseStreamEvent, the later
    turns' prompts came partly from the prefix cache, and what Codex shows is what the server streamed."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    codex = agent_or_fail(CODEX, "Codex CLI is not installed: `make test` puts npm's @openai/codex under "
                          ".venv/node/codex when npm is on PATH (or set CODEX_BIN)")
    server = long_server
    model = server.get("/v1/models").json()["data"][0]["id"]
    project, home = agent_project(tmp_path)
    with RecordingProxy(server.url, force_codex) as proxy:
        (home / "config.toml").write_text(CODEX_CONFIG.format(model=model, url=proxy.url))
        env = {"HOME": str(home), "CODEX_HOME": str(home), "PATH": "/usr/bin:/bin", "DELTASERVE_API_KEY": "unused"}
        done = subprocess.run([codex, "exec", "--strict-config", "--skip-git-repo-check", "--ephemeral", "--json",
                               "What does hello.py print?"], cwd=project, env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=900)
    print("the exchange:\n" + proxy.log() + "\ncodex stdout:\n" + done.stdout + "\nstderr:\n" + done.stderr[-3000:])
    assert done.returncode == 0
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    items = [e["item"] for e in events if e["type"] == "item.completed"]
    runs = [i for i in items if i["type"] == "command_execution"]
    assert len(runs) == 1 and runs[0]["exit_code"] == 0 and 'print("hello")' in runs[0]["aggregated_output"]
    said = [i["text"] for i in items if i["type"] == "agent_message"]
    assert [e["type"] for e in events if e["type"].startswith("turn.")] == ["turn.started", "turn.completed"]

    turns = proxy.posts("/v1/responses")
    assert len(turns) == 3 and all(x["status"] == 200 for x in proxy.exchanges), proxy.log()
    for x in turns:  # Codex's default tool list, whole; the built-in tool named as left out
        kinds = [t["type"] for t in json.loads(x["original"])["tools"]]
        assert {"function", "namespace", "web_search"} <= set(kinds), kinds
        assert x["headers"]["x-deltaserve-dropped-tools"] == "web_search"
    adapter = TypeAdapter(ResponseStreamEvent)
    first, second, third = (streamed_events(x, adapter) for x in turns)
    assert first[0].type == "response.created" and first[-1].type == "response.completed"
    call = [i for i in first[-1].response.output if i.type == "function_call"][0]
    assert call.name == "exec_command" and json.loads(call.arguments) == {"cmd": "cat hello.py"}
    sent = json.loads(turns[1]["original"])["input"]  # what Codex itself sent back
    assert [i["call_id"] for i in sent if i.get("type") == "function_call_output"] == [call.call_id]
    [agent_call] = [i for i in second[-1].response.output if i.type == "function_call"]
    assert (agent_call.namespace, agent_call.name) == NAMESPACE_CALL
    assert json.loads(agent_call.arguments) == {"target": "agent-1"}
    sent = json.loads(turns[2]["original"])["input"]
    back = [i for i in sent if i.get("call_id") == agent_call.call_id]
    assert [(i["type"], i.get("namespace")) for i in back] == [("function_call", NAMESPACE_CALL[0]),
                                                               ("function_call_output", None)], back
    final = third[-1].response
    assert third[-1].type == "response.completed" and final.usage.input_tokens_details.cached_tokens > 0
    assert said == [final.output_text]
    cached = [t[-1].response.usage for t in (first, second, third)]
    print("Codex prefix cache, cached/prompt tokens per turn:",
          [f"{u.input_tokens_details.cached_tokens}/{u.input_tokens}" for u in cached])


def claude_env(home: Path, url: str, model: str) -> dict:
    """Claude Code against deltaserve: its base URL and a key (sent as x-api-key, which a server without
    --api-key does not read), every model alias mapped to the served model, and no traffic but the API's:
    no telemetry, error reports or update checks; its settings live in the test's folder."""
    return {"HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"), "PATH": "/usr/bin:/bin",
            "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "unused", "ANTHROPIC_MODEL": model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CODE_MAX_RETRIES": "0",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1024"}  # its default (32000) is more than this model's context


def test_claude_code_runs_a_tool_call_session(server, tmp_path):
    """`claude -p` with deltaserve as its Anthropic endpoint, through the recording proxy: a forced Read call, which
    Claude Code runs and answers with a tool_result, then the answer. Its requests carry what it sends Anthropic
    (a system message after the first user turn, adaptive thinking, output_config, context_management,
    cache_control, the billing-header line first in the system prompt) and every one is accepted; every event
    streamed parses as the anthropic package's own RawMessageStreamEvent; the second turn's prompt came partly from
    the prefix cache."""
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    claude = agent_or_fail(CLAUDE, "Claude Code is not installed: `make test` puts npm's @anthropic-ai/claude-code "
                           "under .venv/node/claude-code when npm is on PATH (or set CLAUDE_BIN)")

    model = server.get("/v1/models").json()["data"][0]["id"]
    project, home = agent_project(tmp_path)
    target = str(project / "hello.py")
    with RecordingProxy(server.url, force_claude(target)) as proxy:
        done = subprocess.run(
            [claude, "-p", "--output-format", "stream-json", "--verbose", "--no-session-persistence",
             "--tools", "Read", "--allowed-tools", "Read", "--permission-mode", "dontAsk", "--strict-mcp-config",
             "--setting-sources", "", "--system-prompt", AGENT_PROMPT, "What does hello.py print?"],
            cwd=project, env=claude_env(home, proxy.url, model), stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=600)
    print("the exchange:\n" + proxy.log() + "\nclaude stdout:\n" + done.stdout + "\nstderr:\n" + done.stderr[-3000:])
    assert done.returncode == 0
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    result = [e for e in events if e["type"] == "result"]
    assert len(result) == 1 and result[0]["subtype"] == "success" and not result[0]["is_error"]
    blocks = [b for e in events if e["type"] in ("assistant", "user") for b in e["message"]["content"]
              if isinstance(b, dict)]
    uses = [b for b in blocks if b["type"] == "tool_use"]
    assert [(u["name"], u["input"]) for u in uses] == [("Read", {"file_path": target})]
    results = [b for b in blocks if b["type"] == "tool_result"]
    assert len(results) == 1 and 'print("hello")' in str(results[0]["content"]) and not results[0].get("is_error")

    turns = proxy.posts("/v1/messages")
    assert len(turns) == 2 and all(x["status"] == 200 for x in proxy.exchanges), proxy.log()
    first_body = json.loads(turns[0]["original"])
    assert "system" in [m["role"] for m in first_body["messages"]]  # the shape it sends Anthropic, served
    assert first_body["system"][0]["text"].startswith("x-anthropic-billing-header:")
    adapter = TypeAdapter(RawMessageStreamEvent)
    first, second = (streamed_events(x, adapter) for x in turns)
    for turn in (first, second):
        assert turn[0].type == "message_start" and turn[-1].type == "message_stop"
    assert [e.delta.stop_reason for e in first if e.type == "message_delta"] == ["tool_use"]
    assert [e.delta.stop_reason for e in second if e.type == "message_delta"] == ["end_turn"]
    assert result[0]["result"] == '"It prints hello."'  # what Claude Code shows is what the server streamed
    usage = [[e.usage for e in turn if e.type == "message_delta"][0] for turn in (first, second)]
    assert usage[1].cache_read_input_tokens > 0
    print("Claude Code prefix cache, cached/prompt tokens per turn:",
          [f"{u.cache_read_input_tokens}/{u.input_tokens + u.cache_read_input_tokens}" for u in usage])


def force_qwen(target: str):
    """As force_codex, for Qwen Code on either API: a forced read_file of `target`, then a forced edit of it (its one
    line changed), then the answer."""
    def rewrite(path: str, body: dict) -> dict:
        route = path.split("?")[0]
        if route not in ("/v1/chat/completions", "/v1/responses"):
            return body
        chat = route == "/v1/chat/completions"
        for tool in body.get("tools", []):
            function = tool["function"] if chat else tool
            if function["name"] == "read_file":
                function["parameters"] = one_value("file_path", target)
            elif function["name"] == "edit":
                function["parameters"] = {**one_value("file_path", target), "required": ["file_path", *QWEN_EDIT]}
                function["parameters"]["properties"].update({k: {"enum": [v]} for k, v in QWEN_EDIT.items()})
        answered = sum(m.get("role") == "tool" for m in body["messages"]) if chat else sum(
            isinstance(i, dict) and i.get("type") == "function_call_output" for i in body["input"])
        limit = {"max_tokens" if chat else "max_output_tokens": 120}
        if answered < 2:
            name = ("read_file", "edit")[answered]
            return {**body, **limit, "tool_choice": {"type": "function", "function": {"name": name}} if chat
                    else {"type": "function", "name": name}}
        schema = {"name": "answer", "schema": ANSWER}
        return {**body, **limit, "tool_choice": "none", **(
            {"response_format": {"type": "json_schema", "json_schema": schema}} if chat
            else {"text": {"format": {"type": "json_schema", **schema}}})}
    return rewrite


QWEN_EDIT = {"old_string": 'print("hello")', "new_string": 'print("hello, world")'}  # beside its file_path


@pytest.mark.parametrize("auth_type", ["openai", "openai-responses"])
def test_qwen_code_reads_and_writes_a_file(server, tmp_path, auth_type):
    """Qwen Code (`qwen`, one-shot) against deltaserve in each of its OpenAI modes (chat completions, and the
    Responses API), set up as docs/api.md says (OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL and --auth-type),
    through the recording proxy: a forced read_file of hello.py, whose content goes back to the model, a forced
    edit of it, which Qwen Code carries out (auto-edit approval, so it runs unattended), then the answer; every
    request is answered 2xx and the session ends by itself."""
    qwen = agent_or_fail(QWEN, "Qwen Code is not installed: `make test` puts npm's @qwen-code/qwen-code under "
                         ".venv/node/qwen-code when npm is on PATH (or set QWEN_BIN)")
    model = server.get("/v1/models").json()["data"][0]["id"]
    project, home = agent_project(tmp_path)
    route = "/v1/chat/completions" if auth_type == "openai" else "/v1/responses"
    with RecordingProxy(server.url, force_qwen(str(project / "hello.py"))) as proxy:
        env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "OPENAI_BASE_URL": proxy.url + "/v1",
               "OPENAI_API_KEY": "unused", "OPENAI_MODEL": model}
        # --bare (no skills, agents or goals discovered) and a short system prompt: its whole default prompt is
        # ~15K tokens, twice the built-in model's context.
        done = subprocess.run([qwen, "--auth-type", auth_type, "--bare", "--approval-mode", "auto-edit",
                               "--system-prompt", AGENT_PROMPT, "What does hello.py print? Make it greet the world."],
                              cwd=project, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    print("the exchange:\n" + proxy.log() + "\nqwen stdout:\n" + done.stdout + "\nstderr:\n" + done.stderr[-3000:])
    assert done.returncode == 0
    turns = proxy.posts(route)
    assert len(turns) == 3 and all(200 <= x["status"] < 300 for x in proxy.exchanges), proxy.log()
    sent = json.loads(turns[1]["original"])  # what Qwen Code itself sent back after the read
    results = [m["content"] for m in sent["messages"] if m["role"] == "tool"] if auth_type == "openai" else [
        i["output"] for i in sent["input"] if i.get("type") == "function_call_output"]
    assert len(results) == 1 and 'print("hello")' in text_of(results[0])
    assert (project / "hello.py").read_text() == 'print("hello, world")\n'
    assert "It prints hello." in done.stdout
