"""Tool-call parsers: find a model's function calls in its output stream, per model family.

Each parser takes text as it is generated and yields `ToolDelta`s in OpenAI's streaming order: text before a
call as content, then per call its index, id and name first, then its arguments as JSON fragments. The
fragments of one call concatenate to its arguments, and a stream split anywhere parses as the whole text does.

- qwen3_coder: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
  (Qwen3-Coder and the Qwen3.5 family); values are typed by the tool's JSON schema ("5" -> 5 for an integer).
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5, Qwen3).
- llama3_json: the whole answer is `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3; `;` between calls).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from deltaserve.text.scan import partial_tag_len, split_trailing_space

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN = re.compile(r"<function=([^>\n]+)>")
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]+)>")
PARAMETER_CLOSE = "</parameter>"
FUNCTION_CLOSE = "</function>"
# The head of a hermes call written name first: `{"name": "NAME", "arguments": ` before an object.
HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolDelta:
    """One step of a parsed stream: content text, or a piece of call `index` (id and name come first, once)."""

    content: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    """A whole parsed call: its id, the function's name and its arguments as a JSON text."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    """A tool-call id in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """Function name -> its parameters' JSON schema, from an OpenAI `tools` list."""
    out = {}
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            out[function["name"]] = params if isinstance(params, dict) else {}
    return out


def typed_value(raw: str, schema: dict | None):
    """A parameter's text typed by its JSON schema: integers, numbers, booleans, null, objects, arrays."""
    kinds = (schema or {}).get("type", "string")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    text = raw.strip()
    if "string" in kinds and len(kinds) == 1:
        return raw
    if text in ("null", "None") and ("null" in kinds or "string" not in kinds):
        return None
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if "integer" in kinds:
        try:
            return int(text)
        except ValueError:
            pass
    if "number" in kinds:
        try:
            number = float(text)
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
        except ValueError:
            pass
    if kinds != ["string"]:
        try:
            return json.loads(text)
        except ValueError:
            pass
    return raw


class ToolParser:
    """The part every family shares: content until a call's opening tag, whitespace next to calls dropped."""

    open_tag = TOOL_CALL_OPEN

    def __init__(self, tools: list[dict] | None = None, make_id: Callable[[], str] = new_call_id):
        self.schemas = tool_schemas(tools)
        self.make_id = make_id
        self.pending = ""
        self.in_call = False
        self.after_call = False
        self.names: list[str] = []

    @property
    def calls(self) -> int:
        """How many calls have started so far."""
        return len(self.names)

    def push(self, text: str) -> list[ToolDelta]:
        """Add generated text; return the deltas it completes."""
        self.pending += text
        out: list[ToolDelta] = []
        while True:
            if self.in_call:
                if not self._step_call(out):
                    return out
                self.after_call = not self.in_call
                continue
            if self.after_call:
                self.pending = self.pending.lstrip()
                if not self.pending:
                    return out
                self.after_call = False
            start = self.pending.find(self.open_tag)
            if start >= 0:
                before = self.pending[:start].rstrip()
                if before:
                    out.append(ToolDelta(content=before))
                self.pending, self.in_call = self.pending[start + len(self.open_tag):], True
                continue
            # Trailing whitespace waits: it is dropped if a call follows.
            held = partial_tag_len(self.pending, (self.open_tag,))
            body, space = split_trailing_space(self.pending[:len(self.pending) - held])
            if body:
                out.append(ToolDelta(content=body))
            self.pending = space + self.pending[len(self.pending) - held:]
            return out

    def flush(self) -> list[ToolDelta]:
        """The end of the stream: an unfinished call is closed (or kept as content when it never got a name)."""
        out: list[ToolDelta] = []
        if self.in_call:
            rest = self._finish_call(out)
        else:
            rest = self.pending
        self.pending = ""
        if self.calls:
            rest = rest.rstrip()
        if rest:
            out.append(ToolDelta(content=rest))
        return out

    def _step_call(self, out: list[ToolDelta]) -> bool:
        """Consume what the buffer holds of the current call; False when it needs more text."""
        raise NotImplementedError

    def _finish_call(self, out: list[ToolDelta]) -> str:
        """The stream ended inside a call: what of it becomes content (by default all of it, tag included)."""
        return self.open_tag + self.pending

    def _start_call(self, name: str, out: list[ToolDelta]) -> int:
        index = self.calls
        self.names.append(name)
        out.append(ToolDelta(index=index, id=self.make_id(), name=name))
        return index


class HermesParser(ToolParser):
    """JSON `{"name", "arguments"}` between `<tool_call>` tags. Written in that order (as Qwen's templates teach),
    the name is emitted once read and the arguments stream as written; otherwise the call is read whole at
    its closing tag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.streaming: int | None = None  # the call whose arguments are streaming

    def _step_call(self, out: list[ToolDelta]) -> bool:
        if self.streaming is not None:
            return self._step_arguments(out)
        head = HERMES_HEAD.match(self.pending)
        if head is not None:
            self.streaming = self._start_call(json.loads(f'"{head.group(1)}"'), out)
            self.pending = self.pending[head.end():]
            return True
        end = self.pending.find(TOOL_CALL_CLOSE)
        if end < 0:
            return False
        body, self.pending = self.pending[:end], self.pending[end + len(TOOL_CALL_CLOSE):]
        self.in_call = False
        call = _json_call(body.strip(), "arguments")
        if call is None:
            out.append(ToolDelta(content=TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE))
            return True
        index = self._start_call(call[0], out)
        out.append(ToolDelta(index=index, arguments=call[1]))
        return True

    def _step_arguments(self, out: list[ToolDelta]) -> bool:
        """Emit the arguments' text, holding back what may be the call's own closing brace and tag."""
        end = self.pending.find(TOOL_CALL_CLOSE)
        if end >= 0:
            body = self.pending[:end].rstrip()
            arguments = body[:-1].rstrip() if body.endswith("}") else body
            if arguments:
                out.append(ToolDelta(index=self.streaming, arguments=arguments))
            self.pending, self.in_call, self.streaming = self.pending[end + len(TOOL_CALL_CLOSE):], False, None
            return True
        text = self.pending[:len(self.pending) - partial_tag_len(self.pending, (TOOL_CALL_CLOSE,))].rstrip()
        text = (text[:-1] if text.endswith("}") else text).rstrip()
        if text:
            out.append(ToolDelta(index=self.streaming, arguments=text))
            self.pending = self.pending[len(text):]
        return False

    def _finish_call(self, out: list[ToolDelta]) -> str:
        if self.streaming is None:
            return super()._finish_call(out)
        # Cut off inside the arguments (max_tokens): what was written is all there is.
        body = self.pending.rstrip()
        arguments = body[:-1].rstrip() if body.endswith("}") else body
        if arguments:
            out.append(ToolDelta(index=self.streaming, arguments=arguments))
        return ""


class Qwen3CoderParser(ToolParser):
    """XML calls; the name is emitted as soon as `<function=NAME>` is read, then the parameters: a string
    value streams as it is written (a file's content need not wait for its end), a typed one once complete."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.index: int | None = None  # the call being read, once its name is known
        self.params = 0
        self.closing = False  # after </function>: an optional </tool_call> may follow
        self.in_string = False  # inside a string parameter's value, streaming it

    def _step_call(self, out: list[ToolDelta]) -> bool:
        if self.in_string:
            return self._step_string(out)
        if self.closing:
            stripped = self.pending.lstrip()
            if stripped.startswith(TOOL_CALL_CLOSE):
                self.pending = stripped[len(TOOL_CALL_CLOSE):]
            elif TOOL_CALL_CLOSE.startswith(stripped):
                return False
            self.in_call, self.index, self.closing = False, None, False
            return True
        if self.index is None:
            match = FUNCTION_OPEN.search(self.pending)
            if match is None:
                return False
            self.index = self._start_call(match.group(1).strip(), out)
            self.params = 0
            self.pending = self.pending[match.end():]
            return True
        close = self.pending.find(FUNCTION_CLOSE)
        opening = PARAMETER_OPEN.search(self.pending)
        if opening is not None and (close < 0 or opening.start() < close) and self._is_string(opening.group(1)):
            rest = self.pending[opening.end():]
            if not rest:
                return False  # the newline after the tag is not part of the value: wait to see it
            self._open_string(opening.group(1).strip(), out)
            self.pending = rest[1:] if rest.startswith("\n") else rest
            return True
        match = PARAMETER.search(self.pending)
        if match is not None and (close < 0 or match.start() < close):
            self._emit_parameter(match.group(1).strip(), match.group(2), out)
            self.pending = self.pending[match.end():]
            return True
        if close < 0:
            return False
        out.append(ToolDelta(index=self.index, arguments="}" if self.params else "{}"))
        self.pending, self.closing = self.pending[close + len(FUNCTION_CLOSE):], True
        return True

    def _is_string(self, key: str) -> bool:
        """A parameter whose schema says only "string" (or says nothing): its text is its value."""
        schema = self.schemas.get(self.names[self.index], {}).get("properties", {})
        kinds = (schema.get(key.strip()) or {}).get("type", "string") if isinstance(schema, dict) else "string"
        return kinds == "string" or kinds == ["string"]

    def _open_string(self, key: str, out: list[ToolDelta]) -> None:
        prefix = "{" if self.params == 0 else ", "
        out.append(ToolDelta(index=self.index, arguments=f"{prefix}{json.dumps(key, ensure_ascii=False)}: \""))
        self.params += 1
        self.in_string = True

    def _step_string(self, out: list[ToolDelta]) -> bool:
        """Emit the value's text as JSON string fragments; the newline before </parameter> is not part of it."""
        end = self.pending.find(PARAMETER_CLOSE)
        if end >= 0:
            body = self.pending[:end]
            body = body[:-1] if body.endswith("\n") else body
            out.append(ToolDelta(index=self.index, arguments=_json_chars(body) + '"'))
            self.pending, self.in_string = self.pending[end + len(PARAMETER_CLOSE):], False
            return True
        cut = len(self.pending) - partial_tag_len(self.pending, (PARAMETER_CLOSE,))
        if cut and self.pending[cut - 1] == "\n":
            cut -= 1
        if cut:
            out.append(ToolDelta(index=self.index, arguments=_json_chars(self.pending[:cut])))
            self.pending = self.pending[cut:]
        return False

    def _emit_parameter(self, key: str, raw: str, out: list[ToolDelta]) -> None:
        schema = self.schemas.get(self.names[self.index], {}).get("properties", {})
        value = typed_value(raw, schema.get(key) if isinstance(schema, dict) else None)
        prefix = "{" if self.params == 0 else ", "
        out.append(ToolDelta(index=self.index, arguments=f"{prefix}{json.dumps(key, ensure_ascii=False)}: "
                                                         f"{json.dumps(value, ensure_ascii=False)}"))
        self.params += 1

    def _finish_call(self, out: list[ToolDelta]) -> str:
        if self.index is None:
            return self.open_tag + self.pending
        if self.closing:
            return "" if TOOL_CALL_CLOSE.startswith(self.pending.strip()) else self.pending
        # Cut off inside the call (max_tokens): a string value ends where the text does; JSON stays whole.
        if self.in_string:
            out.append(ToolDelta(index=self.index, arguments=_json_chars(self.pending) + '"'))
        out.append(ToolDelta(index=self.index, arguments="}" if self.params else "{}"))
        return ""


class Llama3JsonParser(ToolParser):
    """The answer is JSON calls (after an optional `<|python_tag|>`), or else plain content."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mode = "start"  # "start" until the first non-space character decides: "json" or "text"

    def push(self, text: str) -> list[ToolDelta]:
        self.pending += text
        out: list[ToolDelta] = []
        if self.mode == "start":
            head = self.pending.lstrip()
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG):].lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return out
            self.mode = "json" if head.startswith("{") else "text"
            if self.mode == "json":
                self.pending = head
        if self.mode == "text":
            out.append(ToolDelta(content=self.pending))
            self.pending = ""
            return out
        decoder = json.JSONDecoder()
        while True:
            body = self.pending.lstrip().lstrip(";").lstrip()
            if not body.startswith("{"):
                return out
            try:
                value, end = decoder.raw_decode(body)
            except ValueError:
                return out
            call = _call_of(value, "parameters")
            if call is None:
                return out
            index = self._start_call(call[0], out)
            out.append(ToolDelta(index=index, arguments=call[1]))
            self.pending = body[end:]

    def flush(self) -> list[ToolDelta]:
        rest, self.pending = self.pending, ""
        if self.mode == "start" or self.calls:
            rest = rest.strip()
        return [ToolDelta(content=rest)] if rest else []


PARSERS: dict[str, type[ToolParser]] = {
    "qwen3_coder": Qwen3CoderParser,
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}


def pick_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own tool-call format needs, or None when it shows no tool format."""
    template = chat_template or ""
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if TOOL_CALL_OPEN in template:
        return "hermes"
    if "<|start_header_id|>" in template and '"parameters": ' in template:
        return "llama3_json"
    return None


def make_tool_parser(name: str, tools: list[dict] | None, make_id: Callable[[], str] = new_call_id) -> ToolParser:
    """A fresh parser of family `name` for one response."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}: choose one of {', '.join(PARSERS)}")
    return PARSERS[name](tools, make_id)


def collect(deltas: list[ToolDelta]) -> tuple[str, list[ToolCall]]:
    """Deltas reassembled: the whole content and the whole calls."""
    content, calls = [], {}
    for d in deltas:
        content.append(d.content)
        if d.index is not None:
            call = calls.setdefault(d.index, ToolCall("", "", ""))
            call.id = d.id or call.id
            call.name = d.name or call.name
            call.arguments += d.arguments
    return "".join(content), [calls[i] for i in sorted(calls)]


def _json_chars(text: str) -> str:
    """`text` as the inside of a JSON string (fragments of one value escape as the whole does)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _json_call(text: str, args_key: str) -> tuple[str, str] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _call_of(value, args_key)


def _call_of(value, args_key: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object; either arguments key is accepted."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(args_key, value.get("arguments" if args_key == "parameters" else "parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)
