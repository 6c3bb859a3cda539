"""What to change when a ledger does not fit (two concrete settings, each checked by re-running the ledger), and
what each option costs or gains in KV tokens (`deltaserve plan`'s last table).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from deltaserve.budget.lines import Draft, cuda_paged, draft_ledger, has_mtp_head, mib, serves_images
from deltaserve.budget.spec import ModelMemorySpec
from deltaserve.config import DTYPE_BYTES, ConfigError, EngineConfig, MiB

def fixes_for(spec: ModelMemorySpec, d: Draft, kind: str, ok) -> str:
    """Up to two concrete settings, each checked by re-running the ledger, that make `ok(draft)` true."""
    c = d.c
    tokens_now = d.kv_pages * c.page_size
    short = d.shortfall > 0
    context_problem = d.problem.startswith("--context-length")
    hundredths = round(c.mem_fraction * 100)
    cap = c.max_new_tokens_cap
    candidates = []  # (flag text, setting, values to try in order, extra changes)

    def with_cap(n: int) -> dict:
        return {"max_new_tokens_cap": min(cap, n)} if cap else {}

    def with_context(n: int) -> dict:
        return {"context_length": n} if c.context_length and c.context_length > n else {}

    if context_problem:
        candidates.append(("--context-length {}", "context_length", _descending(tokens_now, 1024), with_cap))
        if c.max_total_tokens is not None:
            candidates.append(("--max-total-tokens {}", "max_total_tokens", [d.context], _none))
    elif c.max_total_tokens is not None:
        candidates.append(("--max-total-tokens {}", "max_total_tokens", _descending(c.max_total_tokens, 1000),
                           with_context))
    if short:
        candidates.append(("raise --mem-fraction to {:.2f}", "mem_fraction",
                           [f / 100 for f in range(hundredths + 1, 101)], _none))
    else:
        candidates.append(("lower --mem-fraction to {:.2f}", "mem_fraction",
                           [f / 100 for f in range(hundredths - 1, 0, -1)], _none))
        if c.max_total_tokens is None:
            candidates.append(("--max-total-tokens {}", "max_total_tokens", _descending(tokens_now, 1000),
                               with_context))
    candidates.append(("--max-running-requests {}", "max_running_requests",
                       range(c.max_running_requests - 1, 0, -1), _none))
    if not cuda_paged(c) and spec.attention_layers and not context_problem:
        candidates.append(("--context-length {}", "context_length", _descending(d.context, 1024), with_cap))
    if c.headroom:
        candidates.append(("--headroom {}", "headroom", [0], _none))
    found = []
    for text, name, values, extra in candidates:
        value = _first_fitting(spec, d, kind, ok, name, values, extra)
        if value is not None:
            also = "".join(f" --{k.replace('_', '-')} {v}" for k, v in extra(value).items()
                           if getattr(c, k) is not None and v != getattr(c, k))
            found.append(text.format(value) + also)
        if len(found) == 2:
            break
    if not found:
        return "No single setting fixes it: use a smaller or more quantized model, or a larger device."
    return "Fix: " + " or ".join(found) + "."


def _none(_value) -> dict:
    return {}


def _descending(start: int, step: int) -> list[int]:
    """start rounded down to a multiple of step, then down by step; small values go down by 16."""
    if start < step:
        return list(range(start // 16 * 16, 0, -16))
    return list(range(start // step * step, 0, -step))


def _first_fitting(spec, d: Draft, kind: str, ok, name: str, values, extra):
    for value in values:
        try:
            config = dataclasses.replace(d.c, **{name: value}, **extra(value))
        except ConfigError:
            continue
        if ok(draft_ledger(spec, config, d.total, kind)):
            return value
    return None


class OptionCost(NamedTuple):
    """What one option changes in the KV pool, in tokens of context (negative: it costs them)."""

    option: str
    delta_kv_tokens: int
    note: str


# --speculative auto takes the checkpoint's MTP head only where the KV pool keeps at least this share of the tokens
# it holds without the head: its weights, its K/V layer and the per-draft GDN states come out of the context (the
# field's 27B on a 24 GiB card: 62,688 tokens without, 27,408 with one draft, none with three), and an agent's
# context is what a memory-tight user runs out of first
AUTO_MTP_MIN_KV_SHARE = 0.75
# Where --speculative auto may draft with the head. Not CUDA yet: the head's passes and the verifying rows have run
# on CPUs only (no GPU has been lent to this project's sessions); bench/cuda_check.py's mtp section checks them on a
# GPU, and CUDA joins here once it has passed there. `--speculative mtp` runs them on CUDA meanwhile.
AUTO_MTP_DEVICES = ("cpu",)


def auto_speculation(spec: ModelMemorySpec, config: EngineConfig, total: int,
                     kind: str) -> tuple[EngineConfig, str | None]:
    """--speculative auto: mtp where the checkpoint has a head, the device is one of AUTO_MTP_DEVICES and the ledger
    with the head's weights, its K/V layer and the draft states keeps AUTO_MTP_MIN_KV_SHARE of the KV pool it has
    without them; otherwise off, with a note of why (what the head would cost, and where it does not fit at all
    the settings that make room). Decided on the device's size, never on what happens to be free at start: one
    config, one ledger, every boot."""
    if config.speculative != "auto":
        return config, None
    off = dataclasses.replace(config, speculative="off")
    if not has_mtp_head(spec):
        return off, None
    if kind not in AUTO_MTP_DEVICES:
        return off, (f"--speculative auto is off on {kind}: MTP drafting has not yet been checked on this device "
                     f"(bench/cuda_check.py); --speculative mtp turns it on")
    mtp = dataclasses.replace(config, speculative="mtp")
    d = draft_ledger(spec, mtp, total, kind)
    if d.shortfall > 0:
        fixes = fixes_for(spec, d, kind, lambda x: x.shortfall <= 0)
        how = (f"--speculative mtp fits with one of: {fixes.removeprefix('Fix: ')}" if fixes.startswith("Fix: ")
               else "no single setting makes room for it")
        return off, (f"--speculative auto is off: with the checkpoint's MTP head {d.problem}: short by "
                     f"{mib(d.shortfall)} MiB; {how}")
    without = draft_ledger(spec, off, total, kind)
    if without.shortfall <= 0 and d.kv_pages < AUTO_MTP_MIN_KV_SHARE * without.kv_pages:
        tokens, base = d.kv_pages * d.c.page_size, without.kv_pages * without.c.page_size
        k = config.speculative_tokens
        return off, (f"--speculative auto is off: the checkpoint's MTP head (its weights, its K/V and {k} GDN draft "
                     f"state{'s' if k != 1 else ''} per running request) would leave {tokens:,} of {base:,} KV "
                     f"tokens; --speculative mtp takes it at that price")
    return mtp, None


def option_costs(spec: ModelMemorySpec, config: EngineConfig, device_total: int, *, device_kind: str | None = None,
                 host_tier_bytes: int = 12 * 1000**3) -> list[OptionCost]:
    """What each option costs (negative) or gains in KV tokens, with the pool sized from memory, uncapped."""
    kind = device_kind or config.device_kind()
    config = auto_speculation(spec, config, device_total, kind)[0]  # priced as plan_budget decides it
    base_config = dataclasses.replace(config, max_total_tokens=None)
    base = draft_ledger(spec, base_config, device_total, kind, pricing=True)
    c, tokens = base.c, base.kv_pages * base.c.page_size
    costs = []

    def delta(**changes) -> int | None:
        d = draft_ledger(spec, dataclasses.replace(base_config, **changes), device_total, kind, pricing=True)
        return None if d.shortfall > 0 else d.kv_pages * c.page_size - tokens

    for step in (0.01, -0.01):
        f = round(c.mem_fraction + step, 2)
        if 0 < f <= 1 and (n := delta(mem_fraction=f)) is not None:
            note = f"{step:+.2f} x device = {step * base.total / MiB:+,.0f} MiB"
            costs.append(OptionCost(f"--mem-fraction {f:.2f}", n, note))
    if spec.gdn_layers:
        other = "bfloat16" if c.state_dtype == "float32" else "float32"
        if (n := delta(state_dtype=other)) is not None:
            costs.append(OptionCost(f"--state-dtype {other}", n,
                                    f"GDN state {spec.state_bytes_per_slot(other) / MiB:,.1f} "
                                    f"MiB/request instead of {spec.state_bytes_per_slot(c.state_dtype) / MiB:,.1f}"))
    if serves_images(spec, c) and (n := delta(language_model_only=True)) is not None:
        costs.append(OptionCost("--language-model-only", n, f"no images: the vision tower's weights "
                                f"({mib(base.lines['vision_weights'][0])} MiB) and workspace "
                                f"({mib(base.lines['vision_workspace'][0])} MiB) become KV"))
    elif spec.vision is not None and c.language_model_only and (n := delta(language_model_only=False)) is not None:
        costs.append(OptionCost("images (without --language-model-only)", n, "loads the vision tower and its "
                                "workspace"))
    if (n := delta(max_running_requests=c.max_running_requests + 1)) is not None:
        costs.append(OptionCost(f"--max-running-requests {c.max_running_requests + 1}", n,
                                "one more state slot, sampler row and decode row"))
    if DTYPE_BYTES[c.kv_dtype] > 1 and (n := delta(kv_dtype="float8_e4m3fn")) is not None:
        costs.append(OptionCost("--kv-dtype fp8", n, f"{spec.kv_bytes_per_token('float8_e4m3fn'):,} bytes/token "
                                f"instead of {base.bpt:,} (needs a KV pool that stores fp8)"))
    costs.append(_host_tier_cost(spec, c, base, host_tier_bytes))
    if spec.gdn_layers and c.prefix_cache:
        per = spec.state_bytes_per_slot(c.state_dtype) / base.bpt
        more = 2 * c.checkpoint_slots
        if (n := delta(checkpoint_slots=more)) is not None:
            costs.append(OptionCost(f"--checkpoint-slots {more}", n,
                                    f"{more - c.checkpoint_slots} more reusable prefix states at {per:,.0f} KV tokens "
                                    f"each: {more // 2} conversations keep their last message and a branch point"))
        if (n := delta(prefix_cache=False)) is not None:
            costs.append(OptionCost("--no-prefix-cache", n, "no checkpoints: every turn of a conversation is read "
                                                            "again from its first token"))
    if spec.gdn_layers and c.speculative == "off":
        if has_mtp_head(spec) and (n := delta(speculative="mtp")) is not None:
            costs.append(OptionCost(f"--speculative mtp (--speculative-tokens {c.speculative_tokens})", n,
                                    f"the checkpoint's MTP head: its weights, one more K/V layer and "
                                    f"{c.speculative_tokens} GDN states per running request"))
        if (n := delta(speculative="ngram")) is not None:
            costs.append(OptionCost(f"--speculative ngram (--speculative-tokens {c.speculative_tokens})", n,
                                    f"{c.speculative_tokens} GDN states per running request, to roll back "
                                    f"rejected drafts"))
    elif spec.gdn_layers and (n := delta(speculative="off")) is not None:
        costs.append(OptionCost("--speculative off", n, "no draft states kept"))
    if spec.gdn_layers:
        scales = 4 * spec.gdn_num_v_heads * spec.gdn_key_head_dim  # one fp32 scale per state row
        int8_slot = spec.gdn_layers * (spec.state_elements_per_layer() + scales)
        pool = c.max_running_requests * int8_slot
        costs.append(OptionCost(f"INT8 GDN state checkpoints x{c.max_running_requests}", -math.ceil(pool / base.bpt),
                                f"{pool / MiB:,.0f} MiB added on top of the working pool ({int8_slot / MiB:,.1f} MiB "
                                f"each: {spec.state_bytes_per_slot(c.state_dtype) / int8_slot:.1f}x more prefixes "
                                f"per byte than {c.state_dtype}), not replacing it"))
    return costs


def _host_tier_cost(spec: ModelMemorySpec, c: EngineConfig, base: Draft, host_bytes: int) -> OptionCost:
    """A host-RAM prefix tier split by the device pools' byte ratio (field notes, incident 5)."""
    kv_bytes, state_bytes = base.lines["kv_pool"][0], base.lines["state_pool"][0]
    per_state = spec.state_bytes_per_slot(c.state_dtype)
    kv_share = kv_bytes / (kv_bytes + state_bytes) if kv_bytes + state_bytes else 1.0
    prefix_tokens = int(host_bytes * kv_share // base.bpt) if base.bpt else 0
    states = int(host_bytes * (1 - kv_share) // per_state) if per_state else 0
    note = f"{host_bytes / 1000**3:.0f} GB of RAM: {prefix_tokens:,} tokens of cached prefix KV"
    if spec.gdn_layers:
        note += (f", but GDN state for only {states:,} prefixes: a hybrid prefix hit needs the state at that exact "
                 f"point, so most hits recompute")
    return OptionCost(f"host prefix tier {host_bytes / 1000**3:.0f} GB", 0, note)
