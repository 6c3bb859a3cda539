"""`deltaserve plan`: the memory ledger of a model on a device, before anything is loaded or allocated.

Works from a config.json alone (weight bytes estimated from the quantization scheme) or from a checkpoint folder /
.gguf file (exact bytes from the headers). Prints the ledger, the longest request, how many requests of a given
context fit at once, and what each option costs in tokens of context; `--json` prints the ledger as GET /v1/budget
serves it, `--chart` draws the device as one stacked bar.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from deltaserve.budget import (Budget, BudgetError, ModelMemorySpec, OptionCost, SpecError, load_spec, option_costs,
                               plan_budget)
from deltaserve.config import ConfigError, EngineConfig, GiB, add_engine_arguments, device_memory_bytes, parse_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags plus the plan's own (`deltaserve plan deploy.toml`, a deployment's ledgers side by side, is
    deploy/plan.py's: the cli sends it there)."""
    add_engine_arguments(parser)
    g = parser.add_argument_group("plan")
    g.add_argument("--quant", help="for a config.json alone: scheme of the linear layers, e.g. w4a16-g128, none")
    g.add_argument("--embed-quant", help="for a config.json alone: embedding scheme, e.g. int8, int4, none")
    g.add_argument("--lm-head-quant", help="for a config.json alone: lm_head scheme, e.g. int4, int8, none")
    g.add_argument("--request-context", type=int, help="tokens per request for 'how many fit at once' (the context)")
    g.add_argument("--host-tier", default="12GB", help="RAM of a host prefix tier to price (12GB)")
    g.add_argument("--json", action="store_true", help="print the ledger as JSON (as GET /v1/budget serves it)")
    g.add_argument("--chart", metavar="PNG", help="draw the device memory as one stacked bar into this PNG")


def run(args: argparse.Namespace) -> int:
    """Run the plan; 0 on success, 2 with one line on stderr for bad input or a ledger that does not fit."""
    try:
        config = EngineConfig.from_args(args)
        spec = load_spec(config.model, args.quant, args.embed_quant, args.lm_head_quant)
        kind = config.device_kind()
        total = config.device_memory or device_memory_bytes(kind)[0]
        budget = plan_budget(spec, config, device_total_bytes=total, device_kind=kind)
        # what --speculative auto became, and the settings fitted to the device (budget/fit.py)
        config = dataclasses.replace(config, speculative=budget.speculative, **budget.fitted)
        host_tier = parse_bytes(args.host_tier)
        if args.request_context is not None and args.request_context <= 0:
            raise ConfigError(f"--request-context {args.request_context} must be a positive number")
        costs = option_costs(spec, config, total, device_kind=kind, host_tier_bytes=host_tier)
        if args.chart:
            draw_chart(budget, args.chart, title=f"{_model_name(config.model)} on {total / GiB:.1f} GiB {kind}")
    except (ConfigError, SpecError, BudgetError, OSError) as e:
        print(f"deltaserve plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(budget.to_json(), indent=2))
    else:
        print(report(spec, budget, costs, args.request_context, config.model))
    return 0


def _model_name(model: str | None) -> str:
    if not model:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.parent.name if path.name == "config.json" else path.name


def report(spec: ModelMemorySpec, budget: Budget, costs: list[OptionCost], request_context: int | None,
           model: str | None) -> str:
    """The human-readable plan: model line, ledger table, what fits, option costs."""
    layers = f"{spec.num_layers} layers: {spec.attention_layers} attention"
    if spec.gdn_layers:
        layers += f" + {spec.gdn_layers} GDN"
    out = [f"model: {_model_name(model)} ({spec.model_type}, {layers}; weights {spec.quantization},"
           f" {spec.weight_source})", "", budget.to_table(), ""]
    ctx = request_context or budget.max_context_tokens
    pages = math.ceil(ctx / budget.page_size)
    by_kv = budget.kv_pages // pages
    out.append(f"largest context of one request: {budget.max_context_tokens:,} tokens "
               f"(context {budget.context_length:,}, KV pool {budget.kv_tokens:,})")
    out.append(f"requests of {ctx:,} tokens at once: {min(by_kv, budget.state_slots)} "
               f"(KV pool: {by_kv}, state slots: {budget.state_slots})")
    default = (f"{budget.default_max_tokens:,}" if budget.default_max_tokens is not None
               else "the rest of the context")
    out.append(f"a request reserves prompt + min(max_tokens or {default}, cap {budget.max_new_tokens_cap:,}) "
               f"KV tokens and one state slot ({budget.state_bytes_per_slot / 2**20:,.1f} MiB)")
    out.extend(budget.notes)
    out += ["", "what each option costs, in KV tokens (pool sized from memory):",
            f"{'option':<36} {'KV tokens':>12}  note"]
    out += [f"{c.option:<36} {c.delta_kv_tokens:>+12,}  {c.note}" for c in costs]
    return "\n".join(out)


def draw_chart(budget: Budget, path: str, title: str) -> None:
    """The device memory as one stacked horizontal bar, one labelled segment per ledger line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [line for line in budget.lines if line.bytes > 0]
    colors = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(13, 3.2))
    left = 0.0
    for i, line in enumerate(lines):
        width = line.bytes / GiB
        ax.barh(0, width, left=left, color=colors[i % len(colors)], edgecolor="white",
                label=f"{line.name} {width:.2f} GiB")
        if width > budget.device_total_bytes / GiB * 0.06:
            ax.text(left + width / 2, 0, f"{line.name}\n{width:.1f}", ha="center", va="center", fontsize=8)
        left += width
    ax.set_xlim(0, budget.device_total_bytes / GiB)
    ax.set_yticks([])
    ax.set_xlabel("GiB")
    ax.set_title(f"{title}: KV pool {budget.kv_tokens:,} tokens, {budget.state_slots} state slots")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaserve plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
