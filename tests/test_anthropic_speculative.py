"""The Anthropic Messages usage carries the request's draft counts (`speculative: {drafted, accepted}`, as our OpenAI
usage does) where the server speculates, in the body and in the stream's final message_delta; none otherwise."""

import asyncio
import json

from deltaserve.engine.request import RequestOutput
from deltaserve.server import anthropic_stream
from deltaserve.server import anthropic_translate as wire
from deltaserve.text.chat_output import ChatOutputParser, ChatOutputSettings



def final_usage(counts: list[dict | None]) -> dict:
    """The usage of the stream's message_delta when its outputs carry these draft counts (None: not speculating)."""
    async def outputs():
        for n, spec in enumerate(counts):
            last = n == len(counts) - 1
            yield RequestOutput("r", "ab", [n], None, last, "stop" if last else None, 3, n + 1, speculative=spec)

    async def collect():
        parser = ChatOutputParser(ChatOutputSettings())
        return [e async for e in anthropic_stream.stream_events(outputs(), parser, "msg_1", "m", 3)]

    events = [json.loads(e.split(b"data: ", 1)[1]) for e in asyncio.run(collect())]
    return next(e for e in events if e["type"] == "message_delta")["usage"]


def test_messages_usage_reports_drafts_only_when_speculating():
    counts = [{"drafted": 3, "accepted": 1}, {"drafted": 6, "accepted": 4}]
    assert final_usage(counts)["speculative"] == {"drafted": 6, "accepted": 4}  # the request's counts at its end
    assert "speculative" not in final_usage([None, None])
    body = wire.message_body("msg_1", "m", "", "hi", [], "end_turn", None, 3, 2, 0, {"drafted": 5, "accepted": 2})
    assert body["usage"]["speculative"] == {"drafted": 5, "accepted": 2} and body["usage"]["output_tokens"] == 2
    assert "speculative" not in wire.message_body("msg_1", "m", "", "hi", [], "end_turn", None, 3, 2)["usage"]
