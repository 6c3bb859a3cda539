"""`deltaserve stress`: concurrency × prompt tokens × generated tokens against an OpenAI-compatible server.

Exit status: 0 when every request of every cell succeeded or was refused with 429 (a queue doing its
job), 1 when a request failed otherwise or the server stopped answering or restarted, 2 for bad
arguments or a target that cannot be stressed.
"""

import argparse
import asyncio
import sys
import time
from pathlib import Path

from deltaserve.stress.client import (FORCE_FIELDS, Target, TargetError, http_client, parse_target_url, shorten,
                                      usage_probe)
from deltaserve.stress.health import discover
from deltaserve.stress.matrix import MatrixError, PRESETS, build_matrix, field_preset, parse_count_list
from deltaserve.stress.prompts import SERVER_WORDS, PromptError, PromptPlan, calibrate, local_token_counter, prompt_text
from deltaserve.stress.report import markdown_table, summarize, write_chart, write_json
from deltaserve.stress.runner import Progress, RunLimits, run_matrix

DEFAULT_CONCURRENCY = "1,3"
DEFAULT_PROMPT_TOKENS = "1000,14000"
DEFAULT_GEN_TOKENS = "128"
EXTRA_CONNECTIONS = 4  # health and metrics probes beside the request workers
FORCE_PROBE_TOKENS = 4  # a probe asking for this many tokens past EOS shows whether ignore_eos works


class ArgumentError(ValueError):
    """An argument that makes the run impossible; reported as one line, exit 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `deltaserve stress` (lists are validated in `run`, so errors are one clear line)."""
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="server base URL, with or without /v1 (default %(default)s)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--model", default=None, help="model name to request (default: first of /v1/models)")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                        help="/v1/chat/completions (default) or /v1/completions")
    parser.add_argument("--concurrency", default=None,
                        help=f"parallel clients, e.g. 1,3,8 (default {DEFAULT_CONCURRENCY})")
    parser.add_argument("--prompt-tokens", default=None,
                        help=f"exact prompt sizes in tokens, e.g. 1000,14k (default {DEFAULT_PROMPT_TOKENS})")
    parser.add_argument("--gen-tokens", default=None,
                        help=f"tokens to generate (max_tokens), e.g. 128,15000 (default {DEFAULT_GEN_TOKENS})")
    parser.add_argument("--preset", choices=PRESETS, default=None,
                        help="'field': the field notes' stress tests instead of a matrix")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply the preset's token counts (e.g. 0.01 for a small model on a CPU)")
    parser.add_argument("--rounds", type=int, default=1, help="requests per cell = concurrency x rounds (default 1)")
    parser.add_argument("--duration-limit", type=float, default=900.0,
                        help="seconds one cell may run; unfinished requests then count as timeouts (default 900)")
    parser.add_argument("--recover-wait", type=float, default=30.0,
                        help="seconds to wait for a server that stopped answering before giving up (default 30)")
    parser.add_argument("--probe-interval", type=float, default=1.0, help="seconds between health probes (default 1)")
    parser.add_argument("--tokenizer", default=None,
                        help="model folder or .gguf whose tokenizer sizes the prompts (default: calibrate "
                             "against the server's usage.prompt_tokens)")
    parser.add_argument("--no-force-length", dest="force_length", action="store_false",
                        help="do not send ignore_eos / min_tokens (generations may end early)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt words (default 0)")
    parser.add_argument("--out", default="stress-results", help="folder for stress.json and stress.png")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no live progress display")
    parser.add_argument("--allow-remote", action="store_true", help="allow a --url that is not this machine")


def cells_from_args(args: argparse.Namespace) -> list:
    """The cells to run, from --preset or the three lists; MatrixError when they are not runnable."""
    lists = (args.concurrency, args.prompt_tokens, args.gen_tokens)
    if args.preset:
        if any(value is not None for value in lists):
            raise MatrixError("give either --preset or --concurrency/--prompt-tokens/--gen-tokens, not both")
        return field_preset(args.scale, rounds=args.rounds)
    return build_matrix(parse_count_list(DEFAULT_CONCURRENCY if args.concurrency is None else args.concurrency,
                                         "--concurrency"),
                        parse_count_list(DEFAULT_PROMPT_TOKENS if args.prompt_tokens is None else args.prompt_tokens,
                                         "--prompt-tokens"),
                        parse_count_list(DEFAULT_GEN_TOKENS if args.gen_tokens is None else args.gen_tokens,
                                         "--gen-tokens"),
                        rounds=args.rounds)


def check_limits(args: argparse.Namespace) -> None:
    """Times must be positive and finite: they are what makes the run stop by itself."""
    for name, value in (("--duration-limit", args.duration_limit), ("--recover-wait", args.recover_wait),
                        ("--probe-interval", args.probe_interval)):
        low = 0.0 if name == "--recover-wait" else 1e-3
        if not (low <= value < float("inf")):
            raise ArgumentError(f"{name}: {value} must be a finite number of seconds >= {low:g}")


class Prober:
    """Tiny non-streamed requests to the target, counted (the report says how many it sent beside the cells)."""

    def __init__(self, client, target: Target):
        self.client, self.target, self.sent = client, target, 0

    async def __call__(self, prompt: str, **fields) -> dict:
        self.sent += 1
        return await usage_probe(self.client, self.target, prompt, **fields)


def load_counter(args: argparse.Namespace):
    """The local token counter of --tokenizer, or None; ArgumentError when the path holds no tokenizer."""
    if args.tokenizer is None:
        return None
    from deltaserve.weights import CheckpointError

    try:
        return local_token_counter(args.tokenizer, args.endpoint)
    except (OSError, ValueError, CheckpointError) as e:
        raise ArgumentError(f"--tokenizer: {shorten(str(e))}") from None


async def prompt_plan(probe: Prober, count, args: argparse.Namespace, notes: list[str]):
    """The prompt plan and, with a local counter, that counter corrected to the server's own count."""
    if count is None:
        async def server_count(text: str) -> int:
            return (await probe(text))["usage"]["prompt_tokens"]

        return await calibrate(server_count, "server usage probes", want=SERVER_WORDS), None
    async def local_count(text: str) -> int:
        return count(text)

    plan = await calibrate(local_count, f"tokenizer {args.tokenizer}")
    server_overhead = (await probe(prompt_text([])))["usage"]["prompt_tokens"]
    offset = server_overhead - plan.overhead_tokens
    if offset == 0:
        return plan, count
    notes.append(f"the server counts {offset:+d} tokens per request beyond the local tokenizer "
                 f"(template or BOS differ); prompts corrected")
    corrected = PromptPlan(overhead_tokens=server_overhead, words=plan.words, source=plan.source)
    return corrected, (lambda text: count(text) + offset)


async def accepted_force_fields(probe: Prober, notes: list[str]) -> tuple[str, ...]:
    """The fields that ask for a full-length generation which the server accepts (both, one, or none)."""
    refusal = ""
    for fields in (FORCE_FIELDS, *((name,) for name in FORCE_FIELDS)):
        try:
            answer = await probe(prompt_text(["hello"]), force_fields=fields, max_tokens=FORCE_PROBE_TOKENS)
        except TargetError as e:
            refusal = refusal or shorten(str(e))
            continue
        got = answer["usage"].get("completion_tokens")
        if isinstance(got, int) and got < FORCE_PROBE_TOKENS:
            notes.append(f"server took {'/'.join(fields)} but generated {got} of {FORCE_PROBE_TOKENS} tokens "
                         f"in the probe: it may ignore them")
        if fields != FORCE_FIELDS:
            notes.append(f"server accepts only {fields[0]} of {'/'.join(FORCE_FIELDS)} ({refusal})")
        return fields
    notes.append(f"server refused {'/'.join(FORCE_FIELDS)} ({refusal}); generations may end early")
    return ()


class LiveDisplay:
    """A rich progress bar per cell on stderr."""

    def __init__(self, enabled: bool):
        self.progress = None
        self.tasks = {}
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
                TimeElapsedColumn

            self.progress = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                         TimeElapsedColumn(), console=Console(stderr=True))

    def callbacks(self) -> Progress:
        return Progress(cell_started=self._started, request_done=self._done, cell_done=self._cell_done)

    def _task(self, cell):
        if cell.label not in self.tasks:
            self.tasks[cell.label] = self.progress.add_task(cell.label, total=cell.requests)
        return self.tasks[cell.label]

    def _started(self, cell, index):
        if self.progress:
            self._task(cell)

    def _done(self, cell, result):
        if self.progress:
            mark = "" if result.ok else f" [red]last failure: {result.failure[:60]}[/red]"
            self.progress.update(self._task(cell), advance=1, description=f"{cell.label}{mark}")

    def _cell_done(self, run):
        if self.progress and run.not_run_reason:
            self.progress.update(self._task(run.cell), description=f"{run.cell.label} not run")

    def __enter__(self):
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.progress:
            self.progress.stop()


async def stress(args: argparse.Namespace, cells: list) -> tuple[list[dict], dict]:
    """Probe the target, size the prompts, run every cell; (cell summaries, run metadata)."""
    root, api = parse_target_url(args.url, args.allow_remote)
    target = Target(root_url=root, api_url=api, model=args.model, endpoint=args.endpoint, api_key=args.api_key)
    max_concurrency = max(cell.concurrency for cell in cells)
    local_count = load_counter(args)
    async with http_client(max_concurrency + EXTRA_CONNECTIONS, args.duration_limit) as client:
        info = await discover(client, target, args.recover_wait)
        target = Target(root_url=root, api_url=api, model=info.model, endpoint=args.endpoint, api_key=args.api_key)
        notes = list(info.notes)
        probe = Prober(client, target)
        plan, count = await prompt_plan(probe, local_count, args, notes)
        for cell in cells:
            try:
                plan.words_for(cell.prompt_tokens)
            except PromptError as e:
                raise ArgumentError(f"cell {cell.label}: {e}") from None
        force = await accepted_force_fields(probe, notes) if args.force_length else ()
        limits = RunLimits(cell_duration_s=args.duration_limit, probe_interval_s=args.probe_interval,
                           recover_wait_s=args.recover_wait)
        started = time.time()
        with LiveDisplay(args.progress and sys.stderr.isatty()) as display:
            runs = await run_matrix(client, target, info, cells, plan, seed=args.seed, limits=limits,
                                    force_fields=force, count_tokens=count, progress=display.callbacks())
    meta = {"url": args.url, "model": info.model, "endpoint": args.endpoint, "started_at": started,
            "prompt_source": plan.source, "request_overhead_tokens": plan.overhead_tokens,
            "prompt_words": len(plan.words), "force_fields": list(force), "seed": args.seed,
            "cell_duration_limit_s": args.duration_limit, "probe_requests": probe.sent, "notes": notes}
    return [summarize(run) for run in runs], meta


def make_out_dir(path: str) -> Path:
    """The --out folder, created before any request is sent (a run must not end unable to write)."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArgumentError(f"--out: cannot create {out}: {e.strerror or e}") from None
    if not out.is_dir():
        raise ArgumentError(f"--out: {out} is not a folder")
    return out


def run(args: argparse.Namespace) -> int:
    """Run `deltaserve stress` with parsed `args`; the exit status."""
    try:
        check_limits(args)
        cells = cells_from_args(args)
        out = make_out_dir(args.out)
        summaries, meta = asyncio.run(stress(args, cells))
    except (MatrixError, TargetError, ArgumentError, PromptError) as e:
        print(f"deltaserve stress: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("deltaserve stress: interrupted", file=sys.stderr)
        return 130
    write_json(out / "stress.json", summaries, meta)
    write_chart(out / "stress.png", summaries)
    print(f"## deltaserve stress: {meta['url']} model {meta['model']} ({meta['endpoint']})\n")
    for note in meta["notes"]:
        print(f"- {note}")
    print(f"- prompts sized by {meta['prompt_source']}; a request with no words costs "
          f"{meta['request_overhead_tokens']} tokens")
    forced = ", ".join(meta["force_fields"]) or "nothing (generations may end early at EOS)"
    print(f"- full-length generations asked for with: {forced}\n")
    print(markdown_table(summaries))
    print(f"\nwrote {out / 'stress.json'} and {out / 'stress.png'}", file=sys.stderr)
    bad = [s for s in summaries if s["verdict"] not in ("ok", "queued/refused (429), no crash")]
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m deltaserve.stress ...`."""
    parser = argparse.ArgumentParser(prog="deltaserve stress", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
