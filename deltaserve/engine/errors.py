"""Internal errors as clients see them: a short id and the component that failed, never a request's content; the log
carries the detail. A request the engine will not take is `Refused`, one type from admission to the HTTP body.

A failure's exception text can hold any request's repr (its prompt token ids), so it never leaves the server:
the client gets "internal error, id 3f9c0a1b2d4e: gdn_block (kernels/decode_cpu.py, run_with) failed; see the
server log" and the log line with that id has the rest. The component is read from where the error was raised (a
file and function of ours, and a native kernel's entry point when its check fired), which is code, not content.
"""

from __future__ import annotations

import re
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

ERROR_ID_HEX_DIGITS = 12  # 48 bits: ids of one server's errors do not collide in practice
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # deltaserve/: frames in it are ours
# A native kernel's TORCH_CHECK text opens with its C++ entry point's name ("gdn_block: head shapes"); only that name
# is kept, the rest may quote a request's values (a token id out of range).
NATIVE_ENTRY = re.compile(r"([a-z][a-z0-9_]*):")


def failed_component(error: BaseException) -> str | None:
    """Which of our components raised `error`: "file (function)" of the innermost frame in deltaserve/, led by the
    native kernel's entry point where a kernel's own check fired; None when no frame is ours."""
    ours = []
    for frame in traceback.extract_tb(error.__traceback__):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(PACKAGE_DIR):
            ours.append((path.relative_to(PACKAGE_DIR).as_posix(), frame.name))
    if not ours:
        return None
    path, function = ours[-1]
    entry = NATIVE_ENTRY.match(str(error)) if isinstance(error, RuntimeError) and path.startswith("kernels/") else None
    return f"{entry.group(1)} ({path}, {function})" if entry else f"{path} ({function})"


def internal_error(log: Callable[[str], None], context: str, error: BaseException | None = None) -> str:
    """Log `context` and the error's traceback under a new id; return the message a client may see: the id and the
    component that failed."""
    error_id = uuid.uuid4().hex[:ERROR_ID_HEX_DIGITS]
    detail = ""
    if error is not None:
        detail = "\n" + "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
    log(f"deltaserve: internal error id {error_id}: {context}{detail}")
    # what kind of failure it was is no request's content, and an out-of-memory step is one a user can act on
    kind = "out of memory" if type(error).__name__ == "OutOfMemoryError" else "internal error"
    component = None if error is None else failed_component(error)
    where = f"{component} failed; " if component else ""
    return f"{kind}, id {error_id}: {where}see the server log"


class Refused(Exception):
    """Work the engine will not take: `status` (400, or 429 with `retry_after_s` when the queue is full), the request
    field at fault (`param`, or None) and `code`; `message` names what was wrong and the limit. Admission raises it
    (engine/scheduler.py), the door's checks raise it (engine/door.py), and the server renders it as it is."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s
