"""Internal errors as clients see them: a short id, never a request's content; the log carries the detail.

A failure's exception text can hold any request's repr (its prompt token ids), so it never leaves the server:
the client gets "internal error, id 3f9c0a1b2d4e: see the server log" and the log line with that id has the rest.
"""

from __future__ import annotations

import traceback
import uuid
from collections.abc import Callable

ERROR_ID_HEX_DIGITS = 12  # 48 bits: ids of one server's errors do not collide in practice


def internal_error(log: Callable[[str], None], context: str, error: BaseException | None = None) -> str:
    """Log `context` and the error's traceback under a new id; return the message a client may see."""
    error_id = uuid.uuid4().hex[:ERROR_ID_HEX_DIGITS]
    detail = ""
    if error is not None:
        detail = "\n" + "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
    log(f"deltaserve: internal error id {error_id}: {context}{detail}")
    # what kind of failure it was is no request's content, and an out-of-memory step is one a user can act on
    kind = "out of memory" if type(error).__name__ == "OutOfMemoryError" else "internal error"
    return f"{kind}, id {error_id}: see the server log"
