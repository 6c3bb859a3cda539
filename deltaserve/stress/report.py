"""Turning cell runs into numbers: per-cell statistics, a markdown table, JSON and a PNG chart."""

import json
import math
from collections import Counter
from pathlib import Path

from deltaserve.stress.runner import CellRun, server_down, server_restarted, stopped_at_s

TOP_FAILURES = 5  # distinct error texts listed per cell in the markdown details


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def verdict(run: CellRun, failures: int, refused: int) -> str:
    """One phrase for the cell: what the server did under this load."""
    if run.not_run_reason:
        return f"not run: {run.not_run_reason}"
    if server_down(run):
        at = stopped_at_s(run)
        back = "" if run.back_after_s is None else f", answering again {run.back_after_s:.0f} s after the cell"
        return f"server stopped answering{'' if at is None else f' at +{at:.1f} s'}{back}"
    if server_restarted(run):
        return "server restarted"
    if failures:
        return "errors"
    if refused:
        return "queued/refused (429), no crash"
    return "ok"


def summarize(run: CellRun) -> dict:
    """The statistics of one cell, as plain JSON-ready values (times in seconds, speeds in tokens/s)."""
    cell, results = run.cell, run.results
    ok = [r for r in results if r.ok]
    refused = [r for r in results if r.kind == "refused"]
    failed = [r for r in results if not r.ok and r.kind != "refused"]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok]
    prefill = [r.prompt_tokens / r.ttft_s for r in ok if r.prompt_tokens and r.ttft_s]
    decode = [(r.completion_tokens - 1) / (r.last_token_s - r.ttft_s) for r in ok
              if r.completion_tokens and r.completion_tokens > 1 and r.ttft_s is not None
              and r.last_token_s is not None and r.last_token_s > r.ttft_s]
    generated = [r.completion_tokens for r in ok if r.completion_tokens is not None]
    reported = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    queued = [s.queued for s in run.health if s.queued is not None]
    answered = [s for s in run.health if s.answering]
    spec = [r.speculative for r in ok if r.speculative is not None]
    drafted, accepted = (sum(s.get("drafted", 0) for s in spec), sum(s.get("accepted", 0) for s in spec))
    return {
        "cell": cell.label, "note": cell.note,
        "concurrency": cell.concurrency, "prompt_tokens": cell.prompt_tokens, "gen_tokens": cell.gen_tokens,
        "planned": cell.requests, "sent": len(results), "not_sent": cell.requests - len(results),
        "succeeded": len(ok), "refused_429": len(refused), "failed": len(failed),
        "failures": dict(Counter(r.failure for r in refused + failed).most_common()),
        "prompt_tokens_reported": {"min": min(reported, default=None), "max": max(reported, default=None),
                                   "matching": sum(1 for n in reported if n == cell.prompt_tokens),
                                   "reported": len(reported)},
        "gen_tokens_got": {"min": min(generated, default=None), "max": max(generated, default=None),
                           "mean": sum(generated) / len(generated) if generated else None,
                           "forced_with": list(run.force_fields)},
        "ttft_s": {"p50": percentile(ttfts, 50), "p95": percentile(ttfts, 95)},
        "e2e_s": {"p50": percentile(e2es, 50), "p95": percentile(e2es, 95)},
        "prefill_tok_s": {"p50": percentile(prefill, 50), "min": min(prefill, default=None)},
        "decode_tok_s": {"per_request_p50": percentile(decode, 50),
                         "total": sum(generated) / run.wall_s if run.wall_s > 0 and generated else None},
        "wall_s": run.wall_s,
        # draft tokens of a speculating server (usage.speculative), over the requests that reported them
        "speculative": ({"requests": len(spec), "drafted": drafted, "accepted": accepted,
                         "acceptance": accepted / drafted if drafted else None} if spec else None),
        "server": {"stopped_answering": server_down(run), "restarted": server_restarted(run),
                   "health_probes": len(run.health), "health_answered": len(answered),
                   "health_max_latency_s": max((s.latency_s for s in answered), default=None),
                   "max_queued": max(queued, default=None),
                   "stopped_at_s": stopped_at_s(run), "back_after_s": run.back_after_s},
        "verdict": verdict(run, len(failed), len(refused)),
    }


def _num(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _pair(stats: dict, a: str, b: str) -> str:
    return f"{_num(stats[a])} / {_num(stats[b])}"


def markdown_table(summaries: list[dict]) -> str:
    """The run as a markdown table, then one line per distinct failure."""
    head = ("| cell | sent | ok | 429 | failed | TTFT p50/p95 s | prefill tok/s p50 | decode tok/s req p50 / total "
            "| e2e p50/p95 s | gen tokens got | prompt tokens (server) | server |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        got = s["gen_tokens_got"]
        gen = f"{_num(got['min'], 0)}..{_num(got['max'], 0)} of {s['gen_tokens']}" if got["min"] is not None else "-"
        reported = s["prompt_tokens_reported"]
        prompt = (f"{reported['matching']}/{reported['reported']} = {s['prompt_tokens']}"
                  if reported["reported"] else "not reported")
        server = s["verdict"]
        if s["server"]["max_queued"]:
            server += f"; queued up to {s['server']['max_queued']:g}"
        decode = s["decode_tok_s"]
        lines.append(f"| {s['cell']} | {s['sent']}/{s['planned']} | {s['succeeded']} | {s['refused_429']} "
                     f"| {s['failed']} | {_pair(s['ttft_s'], 'p50', 'p95')} | {_num(s['prefill_tok_s']['p50'])} "
                     f"| {_num(decode['per_request_p50'])} / {_num(decode['total'])} "
                     f"| {_pair(s['e2e_s'], 'p50', 'p95')} | {gen} | {prompt} | {server} |")
    details = [f"- {s['cell']}: {s['note']}" for s in summaries if s["note"]]
    details += [f"- {s['cell']}: speculative decoding accepted {sp['accepted']} of {sp['drafted']} draft tokens"
                f" ({_num(None if sp['acceptance'] is None else 100 * sp['acceptance'], 1)}%) over {sp['requests']}"
                f" requests" for s in summaries if (sp := s.get("speculative"))]
    details += [f"- {s['cell']}: {count} x {text}" for s in summaries
                for text, count in list(s["failures"].items())[:TOP_FAILURES]]
    return "\n".join(lines + ([""] + details if details else []))


def write_json(path: Path, summaries: list[dict], meta: dict) -> None:
    """The run's settings and every cell's statistics."""
    path.write_text(json.dumps({"run": meta, "cells": summaries}, indent=2) + "\n")


def write_chart(path: Path, summaries: list[dict]) -> None:
    """A PNG with one panel per measure, one bar group per cell (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [s["cell"] for s in summaries]
    x = list(range(len(labels)))
    zero = lambda v: 0.0 if v is None else v  # noqa: E731  (a missing measure draws no bar)
    panels = [
        ("requests", [("ok", [s["succeeded"] for s in summaries]), ("429", [s["refused_429"] for s in summaries]),
                      ("failed", [s["failed"] for s in summaries])]),
        ("TTFT (s)", [("p50", [zero(s["ttft_s"]["p50"]) for s in summaries]),
                      ("p95", [zero(s["ttft_s"]["p95"]) for s in summaries])]),
        ("prefill tok/s", [("p50", [zero(s["prefill_tok_s"]["p50"]) for s in summaries])]),
        ("decode tok/s", [("per request p50", [zero(s["decode_tok_s"]["per_request_p50"]) for s in summaries]),
                          ("total", [zero(s["decode_tok_s"]["total"]) for s in summaries])]),
        ("end to end (s)", [("p50", [zero(s["e2e_s"]["p50"]) for s in summaries]),
                            ("p95", [zero(s["e2e_s"]["p95"]) for s in summaries])]),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6.0, 0.9 * len(labels) + 2), 2.4 * len(panels)),
                             sharex=True)
    for ax, (title, series) in zip(axes, panels):
        width = 0.8 / len(series)
        for i, (name, values) in enumerate(series):
            ax.bar([xi + (i - (len(series) - 1) / 2) * width for xi in x], values, width, label=name)
        ax.set_ylabel(title)
        ax.legend(fontsize="small", loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    for xi, s in zip(x, summaries):
        if s["verdict"] != "ok":
            axes[0].annotate(s["verdict"][:28], (xi, 0), rotation=90, fontsize="x-small", va="bottom", ha="center")
    axes[-1].set_xticks(x, labels, rotation=45, ha="right", fontsize="small")
    fig.suptitle("deltaserve stress")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
