"""The Responses API's event stream: response.created, response.in_progress, then per output item
output_item.added, its content (content_part.added, output_text.delta / reasoning_text.delta, ...done,
content_part.done; or function_call_arguments.delta / .done; or custom_tool_call_input.delta / .done),
output_item.done, and response.completed
(response.incomplete at max_output_tokens, response.failed on an engine error). The shapes are the openai
package's types under openai/types/responses/, which tests/test_server_responses.py validates every event against.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from deltaserve.server.protocol import sse_event
from deltaserve.server.responses_tools import ServedTools
from deltaserve.server.responses_translate import (Meta, message_item, new_id, output_text_part, reasoning_item,
                                                   response_body, status_of)
from deltaserve.text.chat_output import ChatOutputParser, OutputDelta


class ItemStream:
    """Turns OutputDeltas into item events, one item per kind in order (reasoning, message, each call), and keeps
    the finished items for the final response. A custom tool's input is sent whole when its call ends (the model
    writes it inside JSON arguments)."""

    def __init__(self, tools: ServedTools):
        self.tools = tools
        self.sequence = 0
        self.items: list[dict] = []  # finished items, in output order
        self.open: dict | None = None  # the item being streamed: its kind, id, text so far
        self.called = False

    def event(self, kind: str, **fields) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(body, kind)

    def events(self, delta: OutputDelta) -> list[bytes]:
        out: list[bytes] = []
        if delta.reasoning:
            out += self._ensure(("reasoning",))
            out.append(self._text_delta("response.reasoning_text.delta", delta.reasoning))
        if delta.content:
            out += self._ensure(("message",))
            out.append(self._text_delta("response.output_text.delta", delta.content, logprobs=[]))
        for piece in delta.calls:
            if piece.name is not None:
                self.called = True
                out += self._ensure(("call", piece.index), piece.id, piece.name)
            if piece.arguments:
                self.open["text"] += piece.arguments
                if self.open["custom"]:
                    continue
                out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=self.open["index"], delta=piece.arguments))
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        """Finish the open item (an output with no item at all gets one empty message)."""
        out = [] if self.open is not None else self._ensure(("message",))
        item, self.open = self.open, None
        at = {"item_id": item["id"], "output_index": item["index"]}
        kind = item["kind"][0]
        if kind == "call":
            done = self.tools.call_item(item["id"], item["call_id"], item["name"], item["text"])
            if item["custom"]:
                out.append(self.event("response.custom_tool_call_input.delta", **at, delta=done["input"]))
                out.append(self.event("response.custom_tool_call_input.done", **at, input=done["input"]))
            else:
                out.append(self.event("response.function_call_arguments.done", **at, name=done["name"],
                                      arguments=item["text"]))
        elif kind == "reasoning":
            done = reasoning_item(item["id"], item["text"])
            part = {"type": "reasoning_text", "text": item["text"]}
            out.append(self.event("response.reasoning_text.done", **at, content_index=0, text=item["text"]))
            out.append(self.event("response.content_part.done", **at, content_index=0, part=part))
        else:
            done = message_item(item["id"], item["text"], status)
            out.append(self.event("response.output_text.done", **at, content_index=0, text=item["text"],
                                  logprobs=[]))
            out.append(self.event("response.content_part.done", **at, content_index=0,
                                  part=output_text_part(item["text"])))
        self.items.append(done)
        out.append(self.event("response.output_item.done", output_index=item["index"], item=done))
        return out

    def _ensure(self, kind: tuple, call_id: str | None = None, name: str | None = None) -> list[bytes]:
        if self.open is not None and self.open["kind"] == kind:
            return []
        out = self.close() if self.open is not None else []
        index = len(self.items)
        if kind[0] == "call":
            item_id = new_id("fc")
            added = self.tools.call_item(item_id, call_id, name, "", "in_progress")
            self.open = {"kind": kind, "id": item_id, "index": index, "text": "", "call_id": call_id, "name": name,
                         "custom": added["type"] == "custom_tool_call"}
            out.append(self.event("response.output_item.added", output_index=index, item=added))
            return out
        item_id = new_id("rs" if kind[0] == "reasoning" else "msg")
        self.open = {"kind": kind, "id": item_id, "index": index, "text": ""}
        if kind[0] == "reasoning":
            item = {**reasoning_item(item_id, ""), "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {**message_item(item_id, "", "in_progress"), "content": []}
            part = output_text_part("")
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        out.append(self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                              part=part))
        return out

    def _text_delta(self, kind: str, text: str, **extra) -> bytes:
        self.open["text"] += text
        return self.event(kind, item_id=self.open["id"], output_index=self.open["index"], content_index=0,
                          delta=text, **extra)


async def stream_events(outputs: AsyncIterator, parser: ChatOutputParser, meta: Meta, tools: ServedTools,
                        finish_reason: Callable[[], str | None], usage_of: Callable[[list[dict]], dict],
                        on_done: Callable[[dict], None]) -> AsyncIterator[bytes]:
    """The whole stream. `outputs` yields engine RequestOutputs and raises on failure (then response.failed);
    `tools` names the calls as the client's tools do; `finish_reason()` is the engine's once it ends,
    `usage_of(items)` the usage of the output items; `on_done(response)` gets the final response (for the store)."""
    items = ItemStream(tools)
    start = response_body(meta, [], "in_progress")
    yield items.event("response.created", response=start)
    yield items.event("response.in_progress", response=start)
    try:
        async for out in outputs:
            for piece in items.events(parser.push(out.text)):
                yield piece
            if out.finished:
                for piece in items.events(parser.flush()):
                    yield piece
    except Exception as e:  # the status line has gone out: the failure is a response.failed event
        message = getattr(e, "message", f"{type(e).__name__}: {e}")
        failed = response_body(meta, items.items, "failed", error={"code": "server_error", "message": message})
        yield items.event("response.failed", response=failed)
        return
    status = status_of(finish_reason())
    for piece in items.close(status):
        yield piece
    final = response_body(meta, items.items, status, usage_of(items.items))
    on_done(final)
    yield items.event(f"response.{status}", response=final)
