"""The Responses API's store: recent responses kept in memory for `previous_response_id`, `GET` and `DELETE`
/v1/responses/{id}, bounded in bytes (--responses-store-bytes; the ledger's runtime line counts them on CPU).

Each entry holds its response body and the whole conversation it ended (earlier items, its own input, its output
items), so a follow-up never needs an older entry that may have been evicted. The oldest entries go first.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class StoredResponse:
    body: dict  # the response object, as GET returns it
    conversation: list[dict]  # every item up to and including its output: the input of a follow-up


@dataclass
class _Entry:
    """Held as JSON text, so the bytes counted against the budget are the bytes held (dicts would take several
    times their JSON size, and an uncounted multiple)."""

    body: bytes
    conversation: bytes

    @property
    def size_bytes(self) -> int:
        return len(self.body) + len(self.conversation)


class ResponseStore:
    """Most recent first out of a byte budget; a response larger than the whole budget is not kept."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self.evicted = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()  # routes run on one event loop, but tests and the metrics read from others

    def put(self, body: dict, conversation: list[dict]) -> bool:
        """Keep a finished response; False when the store is off or the response alone is over its budget."""
        entry = _Entry(json.dumps(body).encode(), json.dumps(conversation).encode())
        size = entry.size_bytes
        if size > self.limit_bytes:
            return False
        with self._lock:
            self._drop(body["id"])
            while self._entries and self.used_bytes + size > self.limit_bytes:
                self._drop(next(iter(self._entries)))
                self.evicted += 1
            self._entries[body["id"]] = entry
            self.used_bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
        if entry is None:
            return None
        return StoredResponse(json.loads(entry.body), json.loads(entry.conversation))

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def __len__(self) -> int:
        return len(self._entries)

    def missing(self, response_id: str, field: str) -> str:
        """Why `response_id` cannot be used: the store's limit, so the client knows to send the conversation."""
        if self.limit_bytes == 0:
            return (f"{field}: {response_id!r} is unknown: this server keeps no responses (--responses-store-bytes 0); "
                    f"send the whole conversation as input")
        return (f"{field}: {response_id!r} is not in this server's response store: it was never stored (store: "
                f"false), was deleted, or was evicted; the store keeps the most recent responses within "
                f"{self.limit_bytes:,} bytes (--responses-store-bytes), in memory, until the server restarts "
                f"({self.evicted} evicted so far). Send the whole conversation as input instead")

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.used_bytes -= entry.size_bytes
        return True
