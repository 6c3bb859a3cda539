"""The stress matrix: which cells (concurrency × prompt tokens × generated tokens) to run.

A cell is run by `cell.concurrency` parallel clients sending `cell.requests` requests in all, each
with a prompt of exactly `cell.prompt_tokens` tokens and asking for `cell.gen_tokens` new tokens.
"""

import math
from dataclasses import dataclass

# "14k" means 14,000: the field notes write prompt sizes that way.
THOUSAND_SUFFIXES = {"k": 1000}
MAX_LIST_VALUE = 10_000_000  # a bigger token count or concurrency is a typo, not a test
MAX_CELLS = 512  # a matrix this large would run for days; say so instead
SCALE_RANGE = (1e-4, 10.0)
MIN_SCALED_GEN_TOKENS = 8  # a scaled-down case still decodes enough tokens to measure a decode speed


class MatrixError(ValueError):
    """A matrix argument that cannot be run: empty, not a number, out of range."""


@dataclass(frozen=True)
class Cell:
    """One point of the matrix."""

    concurrency: int
    prompt_tokens: int
    gen_tokens: int
    requests: int
    note: str = ""  # what a preset case stands for

    @property
    def label(self) -> str:
        """Short name used in tables and charts: "c3 p14000 g128"."""
        return f"c{self.concurrency} p{self.prompt_tokens} g{self.gen_tokens}"


@dataclass(frozen=True)
class FieldCase:
    """One stress test from the field notes, at full size."""

    concurrency: int
    prompt_tokens: int
    gen_tokens: int
    note: str


# FIELD_NOTES.md, "The deployment that finally held": the stress tests that passed.
FIELD_CASES = (
    FieldCase(3, 14_000, 128, "3 concurrent x 14K prompts"),
    FieldCase(3, 14_000, 15_181, "3 concurrent x 14K prompts, real 15,181-token generation"),
    FieldCase(1, 12_000, 128, "single 12K prompt (field: ~5 s)"),
    FieldCase(1, 22_000, 128, "single 22K prompt (field: ~19 s)"),
    FieldCase(1, 36_000, 128, "single 36K prompt (field: ~25 s)"),
    FieldCase(1, 72_000, 128, "single 72K prompt (field: ~44 s)"),
)
PRESETS = ("field",)


def parse_count(text: str, name: str) -> int:
    """One positive integer from `text` ("3", "14000", "14k"); MatrixError naming `name` otherwise."""
    raw = text.strip().lower()
    multiplier = 1
    if raw and raw[-1] in THOUSAND_SUFFIXES:
        multiplier, raw = THOUSAND_SUFFIXES[raw[-1]], raw[:-1]
    try:
        value = int(raw.replace("_", "")) * multiplier
    except ValueError:
        raise MatrixError(f"{name}: {text.strip()!r} is not a whole number (expected e.g. 1,3,8 or 14k)") from None
    if not 1 <= value <= MAX_LIST_VALUE:
        raise MatrixError(f"{name}: {value} is out of range (1 to {MAX_LIST_VALUE:,})")
    return value


def parse_count_list(text: str, name: str) -> list[int]:
    """A comma-separated list of positive integers, in the order given, duplicates dropped."""
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise MatrixError(f"{name}: empty list (expected e.g. 1,3,8)")
    values = []
    for item in items:
        value = parse_count(item, name)
        if value not in values:
            values.append(value)
    return values


def build_matrix(concurrency: list[int], prompt_tokens: list[int], gen_tokens: list[int], *,
                 rounds: int) -> list[Cell]:
    """The full cross product, ordered by generation length, then prompt length, then concurrency."""
    if rounds < 1:
        raise MatrixError(f"--rounds: {rounds} must be at least 1")
    for name, values in (("--concurrency", concurrency), ("--prompt-tokens", prompt_tokens),
                         ("--gen-tokens", gen_tokens)):
        if not values:
            raise MatrixError(f"{name}: empty list, so the matrix has no cells")
    size = len(concurrency) * len(prompt_tokens) * len(gen_tokens)
    if size > MAX_CELLS:
        raise MatrixError(f"the matrix has {size} cells, more than the {MAX_CELLS} one run allows")
    return [Cell(c, p, g, requests=c * rounds)
            for g in gen_tokens for p in prompt_tokens for c in concurrency]


def field_preset(scale: float, *, rounds: int) -> list[Cell]:
    """The field notes' stress tests, token counts multiplied by `scale` (concurrency unchanged).

    Scaled generations keep at least MIN_SCALED_GEN_TOKENS; prompts shrink freely (one that is
    shorter than the request's fixed overhead is refused when prompts are built).
    """
    low, high = SCALE_RANGE
    if not (math.isfinite(scale) and low <= scale <= high):
        raise MatrixError(f"--scale: {scale} is out of range ({low} to {high})")
    if rounds < 1:
        raise MatrixError(f"--rounds: {rounds} must be at least 1")
    return [Cell(case.concurrency, max(1, round(case.prompt_tokens * scale)),
                 max(min(MIN_SCALED_GEN_TOKENS, case.gen_tokens), round(case.gen_tokens * scale)),
                 requests=case.concurrency * rounds, note=case.note)
            for case in FIELD_CASES]
