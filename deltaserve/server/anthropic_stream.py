"""Anthropic's Messages stream: engine outputs as message_start, ping, content_block_start / _delta / _stop (one block
per kind in order: thinking, text, each tool call), message_delta (stop reason, stop sequence, usage) and
message_stop; a failure as one `error` event. The bodies' pieces (usage, stop reason, tool ids) are
anthropic_translate.py's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from deltaserve.server.anthropic_translate import stop_reason, stop_sequence, tool_id, usage
from deltaserve.server.anthropic_wire import error_body
from deltaserve.server.protocol import sse_event
from deltaserve.text.chat_output import ChatOutputParser, OutputDelta


def event(name: str, data: dict) -> bytes:
    """One server-sent event with Anthropic's `event:` line."""
    return sse_event(data, name)


class BlockStream:
    """Turns OutputDeltas into content_block_* events: one block per kind in order (thinking, text, each call)."""

    def __init__(self):
        self.index = -1
        self.open: tuple | None = None  # ("thinking",) | ("text",) | ("tool", call index)
        self.called = False

    def events(self, delta: OutputDelta) -> list[bytes]:
        out: list[bytes] = []
        if delta.reasoning:
            out += self._ensure(("thinking",), {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            out += self._ensure(("text",), {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta.content}))
        for piece in delta.calls:
            if piece.name is not None:
                self.called = True
                out += self._ensure(("tool", piece.index), {"type": "tool_use", "id": tool_id(piece.id),
                                                            "name": piece.name, "input": {}})
            if piece.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": piece.arguments}))
        return out

    def close(self) -> list[bytes]:
        """The stop of the open block (an answer with no block at all gets one empty text block)."""
        out = [] if self.open is not None else self._ensure(("text",), {"type": "text", "text": ""})
        out.append(event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        return out

    def _ensure(self, kind: tuple, block: dict) -> list[bytes]:
        if self.open == kind:
            return []
        out = self.close() if self.open is not None else []
        self.index += 1
        self.open = kind
        out.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block}))
        return out

    def _delta(self, delta: dict) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})


async def stream_events(outputs: AsyncIterator, parser: ChatOutputParser, msg_id: str, model: str,
                        input_tokens: int) -> AsyncIterator[bytes]:
    """The Messages stream: message_start, ping, content blocks, message_delta, message_stop.

    `outputs` yields engine RequestOutputs and raises on failure (sent as an `error` event);
    the last output's finish reason and stop (the stop sequence the engine matched) end it. The prefix
    cache's part of the prompt is known once the request starts: message_start counts the whole prompt as read,
    message_delta's cumulative usage says what the cache supplied.
    """
    start = {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": {**usage(input_tokens, 0), "output_tokens": 0}}
    yield event("message_start", {"type": "message_start", "message": start})
    yield event("ping", {"type": "ping"})
    blocks, output_tokens, cached_tokens, speculative = BlockStream(), 0, 0, None
    finish, stop = None, None
    try:
        async for out in outputs:
            output_tokens = max(output_tokens, out.completion_tokens)
            if out.speculative is not None:
                speculative = out.speculative
            cached_tokens = max(cached_tokens, out.cached_tokens)
            delta = parser.push(out.text)
            for piece in blocks.events(delta):
                yield piece
            if out.finished:
                finish, stop = out.finish_reason, out.stop
                for piece in blocks.events(parser.flush()):
                    yield piece
    except Exception as e:  # the status line has gone out: the failure is an error event
        status = getattr(e, "status", 500)
        yield event("error", error_body(status, getattr(e, "message", f"{type(e).__name__}: {e}")))
        return
    for piece in blocks.close():
        yield piece
    sequence = stop_sequence(stop)
    reason = stop_reason(finish, parser.called, sequence)
    yield event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                     "stop_sequence": sequence},
                                  "usage": {**usage(input_tokens, cached_tokens, speculative),
                                            "output_tokens": output_tokens}})
    yield event("message_stop", {"type": "message_stop"})
