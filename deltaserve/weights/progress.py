"""Load progress in bytes per second, logged (logger "deltaserve.weights") as a checkpoint is read: a line each
PROGRESS_BYTES and one at the end of each file. A 16 GB checkpoint in one GGUF file or a few large shards otherwise
reads for a minute with nothing said; `deltaserve serve` / `generate` show these lines on stderr (cli.py)."""

from __future__ import annotations

import logging
import time

PROGRESS_BYTES = 1 << 30  # a line per GiB read
MiB = 1024 * 1024

log = logging.getLogger("deltaserve.weights")


class LoadProgress:
    """Counts the bytes read from `files` files of `total_bytes` in all, named `what` in each line."""

    def __init__(self, what: str, total_bytes: int, files: int = 1):
        self.what, self.total_bytes, self.files = what, total_bytes, files
        self.started, self.read_bytes = time.monotonic(), 0
        self._next_line = PROGRESS_BYTES

    def read(self, nbytes: int) -> None:
        """`nbytes` more were read: a line each time another PROGRESS_BYTES are done."""
        self.read_bytes += nbytes
        if self.read_bytes >= self._next_line:
            self._next_line = (self.read_bytes // PROGRESS_BYTES + 1) * PROGRESS_BYTES
            seconds = self._seconds()
            log.info("loading %s: %s of %s MiB (%.0f%%) in %.1f s (%s MiB/s)", self.what,
                     f"{self.read_bytes / MiB:,.1f}", f"{self.total_bytes / MiB:,.1f}",
                     100 * self.read_bytes / max(self.total_bytes, 1), seconds,
                     f"{self.read_bytes / MiB / seconds:,.0f}")

    def file_done(self, number: int) -> None:
        """File `number` (1-based) of `files` is read."""
        seconds = self._seconds()
        log.info("read %d/%d shards of %s: %s of %s MiB in %.1f s (%s MiB/s)", number, self.files, self.what,
                 f"{self.read_bytes / MiB:,.1f}", f"{self.total_bytes / MiB:,.1f}", seconds,
                 f"{self.read_bytes / MiB / seconds:,.0f}")

    def _seconds(self) -> float:
        return max(time.monotonic() - self.started, 1e-9)
