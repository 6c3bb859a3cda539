"""The `<think>` reasoning parser: splits a model's output stream into reasoning and answer.

Qwen3 writes `<think>\\n…\\n</think>\\n\\n` before its answer; the Qwen3.5 family's prompt already ends in
`<think>\\n`, so its output holds only the closing tag. Whitespace next to the tags is dropped, as the chat
templates drop it when they render an earlier turn back (`reasoning_content.strip('\\n')`).
"""

from __future__ import annotations

from deltaserve.text.scan import partial_tag_len, split_trailing_space

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def template_reasons(chat_template: str | None) -> bool:
    """Whether a chat template is a reasoning model's (it writes `<think>` blocks)."""
    return bool(chat_template) and THINK_OPEN in chat_template and THINK_CLOSE in chat_template


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves the model inside an open `<think>` block (Qwen3.5's generation prompt)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


class ReasoningParser:
    """push(text) -> (reasoning delta, content delta); flush() at the end of the stream."""

    def __init__(self, in_reasoning: bool = False):
        # "start": the output may still open with <think>; "think": inside it; "answer": after it (or never).
        self.state = "think" if in_reasoning else "start"
        self.pending = ""
        self.reasoning_started = False
        self.answer_started = False

    def push(self, text: str) -> tuple[str, str]:
        """Add generated text; return what is now known to be reasoning and content."""
        self.pending += text
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                head = self.pending.lstrip()
                if head.startswith(THINK_OPEN):
                    self.pending, self.state = head[len(THINK_OPEN):], "think"
                    continue
                if THINK_OPEN.startswith(head):
                    return reasoning, content  # still maybe an opening tag (or only whitespace so far)
                self.state = "answer_plain"
                continue
            if self.state == "think":
                end = self.pending.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += self._reasoning(self.pending[:end], final=True)
                    self.pending, self.state = self.pending[end + len(THINK_CLOSE):], "answer"
                    continue
                held = partial_tag_len(self.pending, (THINK_CLOSE,))
                body, space = split_trailing_space(self.pending[:len(self.pending) - held])
                reasoning += self._reasoning(body, final=False)
                self.pending = space + self.pending[len(self.pending) - held:]
                return reasoning, content
            if self.state == "answer":
                if not self.answer_started:
                    self.pending = self.pending.lstrip()
                    if not self.pending:
                        return reasoning, content
                    self.answer_started = True
            content += self.pending
            self.pending = ""
            return reasoning, content

    def _reasoning(self, text: str, final: bool) -> str:
        if not self.reasoning_started:
            text = text.lstrip("\n")
            self.reasoning_started = bool(text)
        return text.rstrip("\n") if final else text

    def flush(self) -> tuple[str, str]:
        """What is left at the end: an unclosed think block is reasoning; anything else is content."""
        rest, self.pending = self.pending, ""
        if self.state == "think":
            return self._reasoning(rest, final=True), ""
        if self.state == "answer" and not self.answer_started:
            return "", ""
        return "", rest
