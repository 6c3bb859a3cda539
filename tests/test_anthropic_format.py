"""The Anthropic wire format without a model: a reasoning + text + tool-call output, streamed in small pieces,
read back by the `anthropic` package's own stream accumulator, equals the non-streamed body; request blocks
become the chat the template expects."""

import asyncio
import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event

from deltaserve.engine.request import RequestOutput
from deltaserve.server import anthropic_stream
from deltaserve.server import anthropic_translate as wire
from deltaserve.server.protocol import ProtocolError
from deltaserve.text.chat_output import ChatOutputParser, ChatOutputSettings, parse_whole

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}, "timeout_s": {"type": "integer"}}}}}]
OUTPUT = ('<think>\nList the files.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "run", "arguments": '
          '{"command": "ls -la", "timeout_s": 5}}\n</tool_call>\n<tool_call>\n{"name": "run", "arguments": '
          '{"command": "pwd"}}\n</tool_call>')
SETTINGS = ChatOutputSettings(reasoning=True, tool_parser="hermes", tools=tuple(TOOLS))


def stream_bytes(text: str, piece_chars: int) -> list[bytes]:
    pieces = [text[i:i + piece_chars] for i in range(0, len(text), piece_chars)]

    async def outputs():
        for n, piece in enumerate(pieces):
            last = n == len(pieces) - 1
            yield RequestOutput("r", piece, [n], None, last, "stop" if last else None, 3, n + 1)

    async def collect():
        events = anthropic_stream.stream_events(outputs(), ChatOutputParser(SETTINGS), "msg_1", "m", 3)
        return [e async for e in events]

    return asyncio.run(collect())


def test_stream_accumulates_to_the_whole_message():
    reasoning, text, calls = parse_whole(SETTINGS, OUTPUT)
    assert (reasoning, text, [c.name for c in calls]) == ("List the files.", "Let me look.", ["run", "run"])
    whole = wire.message_body("msg_1", "m", reasoning, text, calls, wire.stop_reason("stop", True, None), None,
                              3, len(OUTPUT) // 3 + 1)
    for piece_chars in (1, 3, 7, len(OUTPUT)):
        events = stream_bytes(OUTPUT, piece_chars)
        names = [e.split(b"\n", 1)[0].removeprefix(b"event: ").decode() for e in events]
        assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
        snapshot, bufs = None, {}
        for e in events:
            data = json.loads(e.split(b"data: ", 1)[1])
            if data["type"] != "ping":
                snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=bufs)
        got = snapshot.model_dump(exclude_none=True)
        got_blocks = [{k: v for k, v in b.items() if k != "id"} for b in got["content"]]
        want_blocks = [{k: v for k, v in b.items() if k != "id"} for b in whole["content"]]
        assert got_blocks == want_blocks, piece_chars
        assert got["stop_reason"] == "tool_use"


def test_blocks_become_the_templates_chat():
    req = wire.MessagesRequest(max_tokens=5, system=[{"type": "text", "text": "Be brief."}], messages=[
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "use ls", "signature": "s"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "run",
                                           "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py"},
                                     {"type": "text", "text": "now?"}]}],
        tools=[{"name": "run", "input_schema": TOOLS[0]["function"]["parameters"]}],
        tool_choice={"type": "any"}, thinking={"type": "disabled"})
    chat = wire.to_chat(req)
    assert chat.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "list"},
        {"role": "assistant", "content": "", "reasoning_content": "use ls", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "run", "arguments": {"command": "ls"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py"}, {"role": "user", "content": "now?"}]
    assert chat.tool_choice == "required" and chat.template_kwargs["enable_thinking"] is False
    assert chat.tools[0]["function"]["name"] == "run"


def test_claude_code_requests_become_the_templates_chat():
    """Claude Code's shape: its billing-header line first in the system prompt (dropped: it changes from request to
    request), cache_control on blocks, a system message after the first user turn (kept in place, as a system
    message), adaptive thinking with an effort, context_management and metadata (read, not acted on)."""
    stamp = "x-anthropic-billing-header: cc_version=2.1.332.862; cc_entrypoint=sdk-cli;"
    body = {"max_tokens": 5, "thinking": {"type": "adaptive", "display": "updates"},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "u"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "system": [{"type": "text", "text": stamp},
                       {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "list"}]},
                         {"role": "system", "content": [{"type": "text", "text": "# Environment",
                                                         "cache_control": {"type": "ephemeral"}}]}]}
    chat = wire.to_chat(wire.parse(wire.MessagesRequest, body))
    assert chat.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "list"},
                             {"role": "system", "content": "# Environment"}]
    assert chat.template_kwargs["enable_thinking"] is True and chat.response_schema is None
    low = wire.to_chat(wire.parse(wire.MessagesRequest, {**body, "output_config": {"effort": "low"}}))
    assert low.template_kwargs["enable_thinking"] is False  # adaptive at low effort: no thinking
    on = wire.to_chat(wire.parse(wire.MessagesRequest, {**body, "thinking": {"type": "enabled",
                                                                              "budget_tokens": 1024}}))
    assert on.template_kwargs["enable_thinking"] is True
    plain = wire.to_chat(wire.parse(wire.MessagesRequest, {**body, "system": stamp + "\nBe brief.", "thinking": None}))
    assert plain.messages[0] == {"role": "system", "content": "Be brief."}
    assert "enable_thinking" not in plain.template_kwargs  # no thinking field: the template's default


def test_output_config_format_is_the_answers_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    assert wire.to_chat(wire.parse(wire.MessagesRequest, body)).response_schema == schema
    with pytest.raises(ProtocolError, match="output_config.format"):
        wire.to_chat(wire.parse(wire.MessagesRequest, {**body, "output_config": {"format": {"type": "yaml"}}}))
    with pytest.raises(ProtocolError, match="effort"):
        wire.parse(wire.MessagesRequest, {**body, "output_config": {"effort": "extreme"}})
