"""One chat choice's output stream split into reasoning, answer text and tool calls.

The pipeline is: the `<think>` parser (reasoning models), then the tool-call parser of the model's family
(tool_choice auto), or the reader of a grammar-forced output (tool_choice required or a named function).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from deltaserve.text.reasoning import ReasoningParser
from deltaserve.text.tool_parsers import ToolCall, ToolDelta, make_tool_parser, new_call_id


@dataclass(frozen=True)
class ChatOutputSettings:
    """How one request's output is read: decided once per request from the template, settings and body."""

    reasoning: bool = False  # split <think> blocks off
    in_reasoning: bool = False  # the prompt leaves the model inside <think>
    tool_parser: str | None = None  # the family parser for tool_choice auto
    tools: tuple = ()
    forced: str | None = None  # "required" or "named": the output is grammar-forced JSON
    forced_name: str | None = None


@dataclass
class OutputDelta:
    """What one piece of generated text adds: reasoning, answer text, and tool-call pieces."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChatOutputParser:
    """push(text) -> OutputDelta as text arrives; flush() at the end; `called` once any tool call was read."""

    def __init__(self, settings: ChatOutputSettings, make_id: Callable[[], str] = new_call_id):
        self.settings, self.make_id = settings, make_id
        self.reasoning = ReasoningParser(settings.in_reasoning) if settings.reasoning and not settings.forced else None
        tools = list(settings.tools)
        self.tools = make_tool_parser(settings.tool_parser, tools, make_id) \
            if settings.tool_parser and not settings.forced else None
        self.forced_text: list[str] = []
        self.called = False

    def push(self, text: str) -> OutputDelta:
        """Add generated text."""
        return self._step(text, final=False)

    def flush(self) -> OutputDelta:
        """The end of the output: whatever was held back."""
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> OutputDelta:
        if self.settings.forced:
            return self._forced(text, final)
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.push(text)
            if final:
                more_reasoning, more_content = self.reasoning.flush()
                reasoning, content = reasoning + more_reasoning, content + more_content
        out = OutputDelta(reasoning=reasoning)
        if self.tools is None:
            out.content = content
            return out
        deltas = self.tools.push(content) + (self.tools.flush() if final else [])
        out.content = "".join(d.content for d in deltas)
        out.calls = [d for d in deltas if d.index is not None]
        self.called = self.called or bool(out.calls)
        return out

    def _forced(self, text: str, final: bool) -> OutputDelta:
        """Named: the text is the arguments, streamed as it comes. Required: a JSON array, read at the end."""
        out = OutputDelta()
        if self.settings.forced == "named":
            if not self.called:
                self.called = True
                out.calls.append(ToolDelta(index=0, id=self.make_id(), name=self.settings.forced_name))
            if text:
                out.calls.append(ToolDelta(index=0, arguments=text))
            return out
        self.forced_text.append(text)
        if final:
            try:
                calls = json.loads("".join(self.forced_text))
            except ValueError:  # cut off by max_tokens: the text is all there is
                out.content = "".join(self.forced_text)
                return out
            for index, call in enumerate(calls):
                out.calls.append(ToolDelta(index=index, id=self.make_id(), name=call["name"]))
                out.calls.append(ToolDelta(index=index, arguments=json.dumps(call["arguments"], ensure_ascii=False)))
            self.called = bool(out.calls)
        return out


def parse_whole(settings: ChatOutputSettings, text: str) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, content, calls) of a finished output."""
    parser = ChatOutputParser(settings)
    parts = [parser.push(text), parser.flush()]
    calls: dict[int, ToolCall] = {}
    for d in (c for p in parts for c in p.calls):
        call = calls.setdefault(d.index, ToolCall("", "", ""))
        call.id, call.name = d.id or call.id, d.name or call.name
        call.arguments += d.arguments
    return "".join(p.reasoning for p in parts), "".join(p.content for p in parts), [calls[i] for i in sorted(calls)]
