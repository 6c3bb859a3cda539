"""The admission rule: what a request reserves, when it may start, and when it is refused at once.

Pure policy, no torch. A request reserves `prompt_tokens + min(max_tokens or default, cap)` KV tokens, rounded up
to whole pages, and one GDN state slot; it starts only when that fits beside what running requests reserved
(field notes, incident 3: reserving more than the pool crashed the server). A request that could never fit is
refused with the arithmetic in the message. The scheduler calls exactly these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
KV_POOL_EXCEEDED = "kv_pool_exceeded"
INVALID_MAX_TOKENS = "invalid_max_tokens"


@dataclass(frozen=True)
class Reservation:
    """What one admitted request holds until it finishes: KV pages and one state slot."""

    prompt_tokens: int
    max_new_tokens: int  # the request stops with finish_reason "length" here
    kv_tokens: int  # prompt + max_new_tokens, rounded up to whole pages
    kv_pages: int
    state_slots: int = 1


@dataclass(frozen=True)
class Refusal:
    """Why a request can never run; `message` is the OpenAI-style text for a 400 answer."""

    code: str  # CONTEXT_LENGTH_EXCEEDED, KV_POOL_EXCEEDED or INVALID_MAX_TOKENS
    message: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class AdmissionPolicy:
    """The ledger's numbers that admission needs; build it with `from_budget` in the engine."""

    kv_pool_tokens: int
    page_size: int
    state_slots: int
    context_length: int
    max_new_tokens_cap: int
    default_max_tokens: int | None  # None: what remains of the context
    max_queue: int

    @classmethod
    def from_budget(cls, budget, max_queue: int) -> AdmissionPolicy:
        """The policy of a budget.Budget (pool, slots, the longest context, the cap and the default)."""
        return cls(kv_pool_tokens=budget.kv_tokens, page_size=budget.page_size, state_slots=budget.state_slots,
                   context_length=budget.max_context_tokens, max_new_tokens_cap=budget.max_new_tokens_cap,
                   default_max_tokens=budget.default_max_tokens, max_queue=max_queue)

    @property
    def kv_pool_pages(self) -> int:
        return self.kv_pool_tokens // self.page_size

    def budget_for(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """New-token budget: min(max_tokens or the default, cap). Without max_tokens it also stops at the context."""
        if max_tokens is not None:
            return min(max_tokens, self.max_new_tokens_cap)
        remaining = self.context_length - prompt_tokens
        default = self.default_max_tokens if self.default_max_tokens is not None else remaining
        return min(default, self.max_new_tokens_cap, remaining)

    def reservation(self, prompt_tokens: int, max_tokens: int | None) -> Reservation:
        """The KV tokens (whole pages) and state slot this request would hold."""
        new_tokens = self.budget_for(prompt_tokens, max_tokens)
        pages = math.ceil((prompt_tokens + max(new_tokens, 0)) / self.page_size)
        return Reservation(prompt_tokens, new_tokens, pages * self.page_size, pages)

    def refusal(self, prompt_tokens: int, max_tokens: int | None) -> Refusal | None:
        """Why this request can never run (longer than the context, or than the whole pool), else None."""
        if max_tokens is not None and max_tokens < 0:
            return Refusal(INVALID_MAX_TOKENS, f"max_tokens must be at least 0, got {max_tokens}.", prompt_tokens,
                           max_tokens)
        # at least one token must be generated, unless the request only scores its prompt (max_tokens 0)
        new_tokens = 0 if max_tokens == 0 else max(self.budget_for(prompt_tokens, max_tokens), 1)
        total = prompt_tokens + new_tokens
        if total > self.context_length:
            return Refusal(CONTEXT_LENGTH_EXCEEDED, (
                f"This model's maximum context length is {self.context_length} tokens. However, you requested "
                f"{total} tokens ({prompt_tokens} in the prompt, {new_tokens} for the completion). Please reduce "
                f"the length of the prompt or of the completion (max_tokens)."), prompt_tokens, new_tokens)
        pages = math.ceil(total / self.page_size)
        if pages > self.kv_pool_pages:
            pool_tokens = self.kv_pool_pages * self.page_size
            fits = pool_tokens - prompt_tokens
            advice = (f"Set max_tokens to at most {fits} or shorten the prompt." if fits > 0
                      else "The prompt alone is longer than the pool: shorten it.")
            return Refusal(KV_POOL_EXCEEDED, (
                f"This request needs {pages * self.page_size} KV tokens ({prompt_tokens} in the prompt + {new_tokens} "
                f"for the completion, rounded up to pages of {self.page_size}), but the whole KV pool of this server "
                f"holds {pool_tokens} tokens ({self.kv_pool_pages} pages). {advice}"), prompt_tokens, new_tokens)
        return None

    def most_at_once(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """How many requests of this size can ever be held at once: those that can run together (state slots, and
        whole reservations in the KV pool) plus a full queue. More copies than this (a large `n`) could never be
        admitted together."""
        pages = max(1, self.reservation(prompt_tokens, max_tokens).kv_pages)
        return min(self.state_slots, self.kv_pool_pages // pages) + self.max_queue

    def can_start(self, reservation: Reservation, in_use_kv_pages: int, in_use_slots: int) -> bool:
        """Whether `reservation` fits beside what running requests already reserved."""
        return (in_use_kv_pages + reservation.kv_pages <= self.kv_pool_pages
                and in_use_slots + reservation.state_slots <= self.state_slots)

    def queue_full(self, waiting: int) -> bool:
        """True when `waiting` requests already fill the queue: the server answers 429 with Retry-After."""
        return waiting >= self.max_queue


class AdmissionError(RuntimeError):
    """A bookkeeping mistake: admitting past the pool, admitting twice, releasing what was not admitted."""


@dataclass
class AdmissionLedger:
    """The reservations of running requests; admit and release, never double-release."""

    policy: AdmissionPolicy
    reservations: dict[object, Reservation] = field(default_factory=dict)

    @property
    def in_use_kv_pages(self) -> int:
        return sum(r.kv_pages for r in self.reservations.values())

    @property
    def in_use_slots(self) -> int:
        return sum(r.state_slots for r in self.reservations.values())

    @property
    def free_kv_pages(self) -> int:
        return self.policy.kv_pool_pages - self.in_use_kv_pages

    def can_start(self, reservation: Reservation) -> bool:
        return self.policy.can_start(reservation, self.in_use_kv_pages, self.in_use_slots)

    def try_admit(self, request_id, reservation: Reservation) -> bool:
        """Admit if it fits now; False (nothing changed) when it must wait."""
        if request_id in self.reservations:
            raise AdmissionError(f"request {request_id!r} is already admitted")
        if not self.can_start(reservation):
            return False
        self.reservations[request_id] = reservation
        return True

    def admit(self, request_id, reservation: Reservation) -> None:
        """Admit or raise AdmissionError: for callers that checked can_start first."""
        if not self.try_admit(request_id, reservation):
            raise AdmissionError(f"request {request_id!r} needs {reservation.kv_pages} pages and a slot; "
                                 f"{self.free_kv_pages} pages and {self.policy.state_slots - self.in_use_slots} "
                                 f"slots are free")

    def release(self, request_id) -> Reservation:
        """Return a finished or aborted request's pages and slot (AdmissionError if it holds none)."""
        try:
            return self.reservations.pop(request_id)
        except KeyError:
            raise AdmissionError(f"request {request_id!r} holds no reservation (released twice?)") from None
