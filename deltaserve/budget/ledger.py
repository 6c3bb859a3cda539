"""The memory ledger: every byte the engine will use, named, before anything is allocated.

`plan_budget(spec, config, device_total_bytes=..., device_kind=...)` turns the model's memory shape, the settings
and the device's TOTAL memory into a `Budget`: one line per consumer (bytes and a one-line reason), the KV pool in
tokens and pages, the GDN state pool in slots. It depends only on its inputs, never on what happens to be free
(field notes, incident 2); what is free at start is only checked against it. budget/ is the only package that does
memory arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from deltaserve.budget.advice import auto_speculation, fixes_for
from deltaserve.budget.errors import BudgetError
from deltaserve.budget.fit import fit_to_device
from deltaserve.budget.lines import Draft, draft_ledger, mib
from deltaserve.budget.spec import ModelMemorySpec
from deltaserve.config import DEFAULT_MAX_NEW_TOKENS_CAP, EngineConfig, GiB, MiB

@dataclass
class BudgetLine:
    name: str
    bytes: int
    reason: str


@dataclass
class Budget:
    """The ledger. `lines` cover the whole device: their bytes sum to `device_total_bytes`."""

    lines: list[BudgetLine]
    device_kind: str
    device_total_bytes: int
    mem_fraction: float
    usable_bytes: int  # mem_fraction * total - headroom
    kv_tokens: int
    kv_pages: int
    page_size: int
    kv_bytes_per_token: int
    kv_dtype: str
    state_slots: int
    state_bytes_per_slot: int
    state_dtype: str
    compute_dtype: str
    context_length: int  # configured (or the model's)
    max_context_tokens: int  # the longest one request can be: min(context, pool)
    max_new_tokens_cap: int
    default_max_tokens: int | None  # None: what remains of the context, capped
    max_running_requests: int
    required_bytes: int  # what must be free at start: every consumer line, or the load's peak where higher
    weight_source: str
    model_type: str
    settings: dict
    notes: list[str] = field(default_factory=list)
    checkpoint_slots: int = 0  # GDN state checkpoints of the prefix cache (0: dense model or no prefix cache)
    speculative: str = "off"  # the drafter the ledger priced: off, ngram or mtp (--speculative auto decided)
    fitted: dict = field(default_factory=dict)  # settings not given that were fitted to the device (budget/fit.py)

    def line(self, name: str) -> BudgetLine:
        """The line called `name` (KeyError if there is none)."""
        for line in self.lines:
            if line.name == name:
                return line
        raise KeyError(name)

    def to_json(self) -> dict:
        """The ledger as plain JSON values: what `deltaserve plan --json` prints and GET /v1/budget serves."""
        data = dataclasses.asdict(self)
        data["lines"] = [dataclasses.asdict(line) for line in self.lines]
        return data

    def to_table(self) -> str:
        """A plain-text table: one row per line with GiB and MiB columns and the reason."""
        rows = [f"{'line':<20} {'GiB':>8} {'MiB':>10}  reason", "-" * 100]
        for line in self.lines:
            rows.append(f"{line.name:<20} {line.bytes / GiB:>8.2f} {line.bytes / MiB:>10,.0f}  {line.reason}")
        rows.append("-" * 100)
        rows.append(f"{'device total':<20} {self.device_total_bytes / GiB:>8.2f} "
                    f"{self.device_total_bytes / MiB:>10,.0f}  {self.device_kind}, "
                    f"mem-fraction {self.mem_fraction}, usable {self.usable_bytes / MiB:,.0f} MiB")
        return "\n".join(rows)


@dataclass
class LineCheck:
    name: str
    predicted_bytes: int
    measured_bytes: int

    @property
    def ratio(self) -> float:
        return self.measured_bytes / self.predicted_bytes if self.predicted_bytes else math.inf

    def __str__(self) -> str:
        return (f"{self.name}: predicted {self.predicted_bytes / MiB:,.1f} MiB, measured "
                f"{self.measured_bytes / MiB:,.1f} MiB ({(self.ratio - 1) * 100:+.2f}%)")


def measure_vs_predicted(budget: Budget, measured: dict[str, int]) -> list[LineCheck]:
    """Pair what the engine really allocated (bytes per line name) with the ledger's prediction."""
    return [LineCheck(name, budget.line(name).bytes, int(nbytes)) for name, nbytes in measured.items()]


def plan_budget(spec: ModelMemorySpec, config: EngineConfig, *, device_total_bytes: int, device_kind: str,
                device_free_bytes: int | None = None) -> Budget:
    """The ledger for `spec` on a device of `device_total_bytes` (config.device_memory overrides it).

    Where the ledger does not fit at the defaults, the settings not given are fitted first (budget/fit.py; the
    Budget's `fitted` and first note say which). Raises BudgetError (shortfall in MiB and two fixes) when it still
    does not fit, or when `device_free_bytes`, what is free at start, is less than the consumers need.
    """
    config, note = auto_speculation(spec, config, device_total_bytes, device_kind)
    config, fitted, fit_note = fit_to_device(spec, config, device_total_bytes, device_kind)
    draft = draft_ledger(spec, config, device_total_bytes, device_kind)
    if draft.shortfall > 0:
        fixes = fixes_for(spec, draft, device_kind, lambda d: d.shortfall <= 0)
        raise BudgetError(f"{draft.problem}: short by {mib(draft.shortfall)} MiB. {fixes}")
    if device_free_bytes is not None and device_free_bytes < draft.required:
        short = draft.required - device_free_bytes
        fixes = fixes_for(spec, draft, device_kind,
                       lambda d: d.shortfall <= 0 and d.required <= device_free_bytes)
        raise BudgetError(f"the ledger needs {mib(draft.required)} MiB at start but the device has "
                          f"{mib(device_free_bytes)} MiB free: short by {mib(short)} MiB. {fixes}")
    budget = _finish(spec, draft, device_kind)
    budget.fitted = fitted
    budget.notes[:0] = [fit_note] if fit_note else []
    if note:
        budget.notes.append(note)
    return budget


def _finish(spec: ModelMemorySpec, d: Draft, kind: str) -> Budget:
    c = d.c
    order = ("weights", "vision_weights", "kv_pool", "state_pool", "checkpoint_pool", "speculative_states",
             "prefill_activations", "gdn_workspace", "attention_workspace", "vision_workspace", "sampler",
             "runtime", "headroom", "free", "outside_fraction")
    kv_tokens = d.kv_pages * c.page_size
    max_context = min(d.context, kv_tokens)
    notes = []
    if max_context < d.context:
        notes.append(f"the model's context {d.context:,} is longer than the KV pool: requests are limited "
                     f"to {max_context:,} tokens")
    if c.max_total_tokens is not None and kv_tokens != c.max_total_tokens:
        notes.append(f"--max-total-tokens {c.max_total_tokens:,} rounded down to {kv_tokens:,}: the KV pool holds "
                     f"whole pages of {c.page_size} tokens")
    cap = min(c.max_new_tokens_cap or DEFAULT_MAX_NEW_TOKENS_CAP, max_context)
    if c.max_new_tokens_cap and cap < c.max_new_tokens_cap:
        notes.append(f"--max-new-tokens-cap {c.max_new_tokens_cap:,} lowered to the longest context {cap:,}")
    return Budget(
        lines=[BudgetLine(name, *d.lines[name]) for name in order],
        device_kind=kind, device_total_bytes=d.total, mem_fraction=c.mem_fraction, usable_bytes=d.usable,
        kv_tokens=kv_tokens, kv_pages=d.kv_pages, page_size=c.page_size, kv_bytes_per_token=d.bpt,
        kv_dtype=c.kv_dtype, state_slots=c.max_running_requests,
        checkpoint_slots=c.checkpoint_slots if c.prefix_cache and spec.gdn_layers else 0,
        state_bytes_per_slot=spec.state_bytes_per_slot(c.state_dtype), state_dtype=c.state_dtype,
        compute_dtype=c.dtype, context_length=d.context, max_context_tokens=max_context,
        max_new_tokens_cap=cap, default_max_tokens=c.default_max_tokens,
        max_running_requests=c.max_running_requests, required_bytes=d.required,
        weight_source=spec.weight_source, model_type=spec.model_type, settings=c.to_dict(), notes=notes,
        speculative=c.speculative,
    )
