"""Fitting the settings a user did not give to the device, before any refusal (issue 53): `plan` and `serve` both
get it through plan_budget (budget/ledger.py), so what `plan` prints is what `serve` runs.

A setting the user gave is never changed; where the ledger at the defaults does not fit, the ones left to their
defaults move, in this order, each only as far as needed: --compact-weights (CPU's int8 path: GGUF K-quants held as
their file holds them, -28% weight memory on a Q4_K_M for ~10% of decode speed), --mem-fraction (CPU only) to
CPU_FIT_MEM_FRACTION,
--max-running-requests halved down to 1 (the state pool follows it), --context-length halved in whole pages down to
FIT_CONTEXT_FLOOR, until the KV pool holds one request of the context (or of FIT_KV_TOKENS, an agent's prompt,
where the context is longer: the pool then limits the requests, as at the defaults). Where even that does not fit,
the refusal gives the arithmetic there and the fixes it checked, before any weight is read.
"""

from __future__ import annotations

import dataclasses

from deltaserve.budget.advice import fixes_for
from deltaserve.budget.errors import BudgetError
from deltaserve.budget.lines import Draft, draft_ledger, mib
from deltaserve.budget.spec import ModelMemorySpec
from deltaserve.config import DEFAULT_MAX_RUNNING_REQUESTS, ConfigError, EngineConfig, int8_activation_panels

# The most of a CPU host's RAM fitting budgets: the default 0.5 leaves half to whatever else runs; a model that does
# not fit in it is the host's main job, and the last 10% stays the OS's, other processes' and the page cache's (the
# share a GPU's 0.9 default leaves its driver)
CPU_FIT_MEM_FRACTION = 0.9
# The shortest context fitting shortens to (llama.cpp's --fit keeps 4096 too): less is not a useful chat turn; a
# model that cannot hold one request of it is refused instead
FIT_CONTEXT_FLOOR = 4096
# The KV tokens fitting keeps for one request where the context is longer: a coding agent's prompt (FIELD_NOTES: 10K-
# 60K tokens; the first request of Codex CLI is ~9K, Qwen Code's ~15K). Requests halve before the pool falls below it
# (the field's 27B on 24 GiB: 8 requests over 11,280 tokens had refused a 15K-token prompt)
FIT_KV_TOKENS = 32768


def fit_to_device(spec: ModelMemorySpec, config: EngineConfig, total: int,
                  kind: str) -> tuple[EngineConfig, dict, str | None]:
    """(config, {field: fitted value}, one line naming each fitted flag, its value and why). Where the ledger fits
    at `config` as given, where what does not fit is a pool size or context the user gave, or where the user gave
    every setting fitting moves, `config` comes back unchanged with {} and
    None (plan_budget refuses it as before). Raises BudgetError where even the fitted settings do not fit."""
    before = draft_ledger(spec, config, total, kind)
    # fits, or a --max-total-tokens / --context-length given is what does not: the user's size stands, and so does the
    # refusal; the load's peak (the weights as loaded) is fitted, by --mem-fraction alone
    if before.shortfall <= 0 or before.kv_pages >= 1 and not before.load_short:
        return config, {}, None
    c, fitted, reasons = config, {}, []

    def take(name: str, value, why: str) -> None:
        nonlocal c
        c = dataclasses.replace(c, **{name: value})
        fitted[name] = value
        flag = f"--{name.replace('_', '-')}"
        reasons.append(f"{flag} ({why})" if value is True else f"{flag} {value:,} ({why})" if isinstance(value, int)
                       else f"{flag} {value} ({why})")

    if kind == "cpu" and config.compact_weights is None and int8_activation_panels(kind, before.c.activation_dtype):
        compact = draft_ledger(spec, dataclasses.replace(c, compact_weights=True), total, kind)
        if compact.lines["weights"][0] < before.lines["weights"][0]:  # the model has K-quants to hold so
            take("compact_weights", True, _why(before))
    if kind == "cpu" and config.mem_fraction is None and not _holds(spec, c, total, kind):
        take("mem_fraction", CPU_FIT_MEM_FRACTION, f"at the default {before.c.mem_fraction}, {_why(before)}")
    if draft_ledger(spec, c, total, kind).load_short:  # fewer requests or a shorter context cannot help
        if not fitted:
            return config, {}, None
        raise _refusal(spec, draft_ledger(spec, c, total, kind), kind, reasons)
    if not _holds(spec, c, total, kind) and config.max_running_requests is None:
        start = draft_ledger(spec, c, total, kind)
        n = DEFAULT_MAX_RUNNING_REQUESTS
        while n > 1 and not _holds(spec, dataclasses.replace(c, max_running_requests=n), total, kind):
            n //= 2
        take("max_running_requests", n, f"at {DEFAULT_MAX_RUNNING_REQUESTS}, {_why(start)}")
    if not _holds(spec, c, total, kind) and config.context_length is None:
        start = draft_ledger(spec, dataclasses.replace(c, context_length=spec.max_position_embeddings), total, kind)
        for context in _contexts(spec.max_position_embeddings, c.page_size):
            try:
                trial = dataclasses.replace(c, context_length=context)
            except ConfigError:  # shorter than a --max-new-tokens-cap the user gave
                continue
            if _holds(spec, trial, total, kind) or context == FIT_CONTEXT_FLOOR:  # the floor: for the refusal
                take("context_length", context, f"at the model's {spec.max_position_embeddings:,}, {_why(start)}")
                break
    if not fitted:
        return config, {}, None
    if not _holds(spec, c, total, kind):
        raise _refusal(spec, draft_ledger(spec, c, total, kind), kind, reasons)
    return c, fitted, ("fitted to this machine: " + ", ".join(reasons)
                       + "; give any of them to choose yourself")


def _refusal(spec: ModelMemorySpec, d: Draft, kind: str, reasons: list[str]) -> BudgetError:
    """The refusal where fitting every setting not given as far as it goes still does not fit: the arithmetic there,
    and what else would (fixes_for, each checked)."""
    fitted = ", ".join(reasons)
    if d.shortfall > 0:
        fixes = fixes_for(spec, d, kind, lambda x: x.shortfall <= 0)
        return BudgetError(f"{d.problem}: short by {mib(d.shortfall)} MiB, with the settings not given fitted to "
                           f"this machine as far as they go: {fitted}. {fixes}")
    return BudgetError(f"the KV pool holds {d.kv_pages * d.c.page_size:,} tokens, less than one request of "
                       f"{FIT_CONTEXT_FLOOR:,} (budget/fit.py FIT_CONTEXT_FLOOR), with the settings not given fitted "
                       f"to this machine as far as they go: {fitted}. Use a smaller or more quantized model, or give "
                       f"the settings yourself.")


def _holds(spec: ModelMemorySpec, config: EngineConfig, total: int, kind: str) -> bool:
    """The ledger fits and its KV pool holds one request of the context, or of FIT_KV_TOKENS if shorter."""
    d = draft_ledger(spec, config, total, kind)
    return d.shortfall <= 0 and d.kv_pages * d.c.page_size >= min(d.context, FIT_KV_TOKENS)


def _contexts(model_context: int, page: int) -> list[int]:
    """The model's context halved, in whole pages, down to FIT_CONTEXT_FLOOR (itself the last)."""
    out, context = [], model_context
    while context > FIT_CONTEXT_FLOOR:
        context = max(context // 2 // page * page, FIT_CONTEXT_FLOOR)
        out.append(context)
    return out


def _why(d: Draft) -> str:
    """What did not fit in draft `d`, in MiB or tokens."""
    tokens = d.kv_pages * d.c.page_size
    if d.load_short:
        return (f"the load's peak (the weights as loaded, the runtime) takes {mib(d.load_bytes)} MiB of "
                f"{mib(d.usable)} MiB usable")
    if d.shortfall > 0 and d.kv_pages < 1:
        fixed = d.usable - d.lines["free"][0] - d.lines["kv_pool"][0]
        return f"the lines before the KV pool take {mib(fixed)} MiB of {mib(d.usable)} MiB usable"
    if d.shortfall > 0:
        return f"one request of {d.context:,} tokens does not fit in the KV pool of {tokens:,}"
    return f"the KV pool holds {tokens:,} tokens, less than {FIT_CONTEXT_FLOOR:,}"
