"""What every wire format of the server shares: ProtocolError (a 400 naming the field at fault), pydantic's
validation errors said in one line, the limits every API holds a request to, the default error body (OpenAI's
shape, which the admin routes, the guards and the drain answer in too) and server-sent event framing (every API's
stream).

Each API's own field names live in its own modules: openai_wire.py (the bodies), openai_translate.py (to and from
engine terms) and openai_stream.py; anthropic_wire.py, anthropic_translate.py and anthropic_stream.py;
responses_wire.py, responses_translate.py, responses_tools.py and responses_stream.py. What a request asks of its
output (a forced tool call, a JSON-schema format) is checked once for all of them in output_request.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_COUNT = 2**31 - 1  # token counts beyond int32 are a client mistake, not a request
MAX_STOPS = 16
SSE_DONE = b"data: [DONE]\n\n"


class ProtocolError(ValueError):
    """A request body that is well-formed JSON but not a request we can serve: a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def validation_message(error: ValidationError) -> tuple[str, str | None]:
    """'messages[0].role: Input should be ... (got 'robot')' for the first problem, and its field path."""
    problems = error.errors(include_url=False)
    first = problems[0]
    union = _union_prefix(first["loc"])
    if union is not None:
        # A union field fails once per alternative: name the accepted forms instead of each failure.
        alternatives = [p for p in problems if _union_prefix(p["loc"]) == union]
        outer = min(alternatives, key=lambda p: len(p["loc"]))
        expected = UNION_FORMS.get(re.sub(r"\[\d+\]", "[]", union), "a value of one of the accepted forms")
        others = len(problems) - len(alternatives)
        more = f"; and {others} more problem(s)" if others else ""
        return f"{union}: must be {expected} (got {_short_repr(outer.get('input'))}){more}", union
    param = _field_path(first["loc"])
    got = "" if first["type"] == "missing" else f" (got {_short_repr(first.get('input'))})"
    more = f"; and {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
    where = f"{param}: " if param else "request body: "
    return f"{where}{first['msg']}{got}{more}", param


UNION_FORMS = {
    "prompt": "a non-empty string, a list of non-empty strings, a list of token ids, or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "messages[].content": "a string, a list of content parts, or null",
}
_UNION_TAG = re.compile(r"^(str|int|float|bool|list|dict|none)$|^(constrained-|function-|json-or-python)|\[")


def _union_prefix(loc: tuple) -> str | None:
    """The path of the union field a loc runs through ('prompt' for ('prompt', 'list[int]', 0)), else None."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and _UNION_TAG.search(part):
            return _field_path(loc[:i])
    return None


def _field_path(loc: tuple) -> str | None:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _UNION_TAG.search(part):
            continue
        else:
            path += f".{part}" if path else part
    return path or None


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable"}


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`, as the OpenAI API answers errors."""
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()


def sse_event(body: BaseModel | dict, name: str | None = None) -> bytes:
    """One server-sent event carrying a JSON body (UTF-8, not escaped to ASCII), with an `event:` line when `name`
    is given (Anthropic's and Responses' streams name theirs; OpenAI's do not)."""
    data = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body, ensure_ascii=False)
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {data}\n\n".encode()
