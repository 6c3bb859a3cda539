"""Helpers of the streaming text parsers: find a tag in a growing buffer without emitting half of it."""

from __future__ import annotations


def partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could be the beginning of one of `tags` (0 when none)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def split_trailing_space(text: str) -> tuple[str, str]:
    """(text without its trailing whitespace, that whitespace): held back until we know what follows."""
    stripped = text.rstrip()
    return stripped, text[len(stripped):]
